"""The compared libraries for the tests: benchmarks/peers.py loads them (one implementation);
here each missing one becomes a pytest skip that says why, never a silent pass."""

import pytest

from benchmarks import peers


def timm_model_ema():
    """The real `timm.utils.model_ema` module (loaded without `import timm`), or skip."""
    try:
        return peers.load_timm_model_ema()
    except peers.PeerUnavailable as err:
        pytest.skip(str(err))


def require_pinned_timm():
    """Skip unless the installed timm is the release .ci/env.sh pins: checks of its exact
    signature and checkpoint layouts hold for that release (e.g. timm 1.0.29 has other keywords)."""
    found = peers.timm_version()
    if found != peers.TIMM_VERSION:
        pytest.skip(f"checks timm {peers.TIMM_VERSION}'s own surface; timm {found} is installed")


def require(reason):
    """Skip with `reason` when it is not None (the *_missing() checks of benchmarks.peers)."""
    if reason:
        pytest.skip(reason)


def peer(loader):
    """The module a benchmarks.peers.load_* function returns, or skip saying why."""
    try:
        return loader()
    except peers.PeerUnavailable as err:
        pytest.skip(str(err))
