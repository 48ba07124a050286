"""firstbyte's regional router and the simulated inference server (``router.sim``)."""
