"""firstbyte: take the network out of an LLM application's latency budget."""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    # ``__version__`` is looked up on first use: importlib.metadata costs milliseconds that an
    # application importing the SDK should not pay.
    if name == "__version__":
        return _version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _version() -> str:
    """This checkout's version (its pyproject.toml), else the installed distribution's."""
    from pathlib import Path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        with pyproject.open("rb") as f:
            project = tomllib.load(f).get("project", {})
        if project.get("name") == "firstbyte" and isinstance(project.get("version"), str):
            return str(project["version"])
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("firstbyte")
    except PackageNotFoundError:
        return "0+unknown"
