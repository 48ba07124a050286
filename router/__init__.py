"""firstbyte's regional router and the simulated inference server (``firstbyte.router.sim``)."""
