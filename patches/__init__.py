"""Every change hybrid-prefix-cache makes inside an engine.

One module per patched target. Each module's docstring states what it patches, the engine versions it was
verified on, why, and when it can be removed; each checks the installed engine version through
:func:`require_engine_version` before touching anything. The table in ``docs/patches.md`` lists them all.
"""

from __future__ import annotations

from importlib import metadata


class UnsupportedEngineVersion(RuntimeError):
    """The installed engine is a version this plugin was not verified on."""


def installed_version(*distributions: str) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``distributions`` that is installed, else None."""
    for name in distributions:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def require_engine_version(
    engine: str, distributions: tuple[str, ...], supported_prefixes: tuple[str, ...], patch: str
) -> str:
    """Return the installed version of ``engine`` or raise one clear error naming what is supported.

    ``supported_prefixes`` are release prefixes such as ``"0.5.20"`` or ``"0.32."``; a version matches when it
    starts with one of them (local tags such as ``+cpu`` are ignored).
    """
    found = installed_version(*distributions)
    if found is None:
        raise UnsupportedEngineVersion(f"{patch}: {engine} is not installed (looked for {', '.join(distributions)}).")
    dist, version = found
    public = version.split("+", 1)[0]
    if not any(public == p or (p.endswith(".") and public.startswith(p)) for p in supported_prefixes):
        raise UnsupportedEngineVersion(
            f"hybrid-prefix-cache {patch}: {dist} {version} is not supported; supported {engine} versions: "
            f"{', '.join(p + 'x' if p.endswith('.') else p for p in supported_prefixes)}. "
            "Install a supported version or uninstall hybrid-prefix-cache."
        )
    return public
