"""TRL's BEMACallback (trl 1.16.0), the reference fused_ema.Bema is a drop-in for: the class, or a
pytest skip that gives the import error. .ci/env.sh installs trl with --no-deps (its dependencies
would pull another torch through accelerate), then the pure-Python packages that importing
trl.trainer.callbacks needs: datasets, pandas, pyarrow."""

import pytest

from benchmarks import peers


def trl_bema_callback() -> type:
    """`trl.BEMACallback` (from trl.trainer.callbacks), or skip saying why it cannot be imported."""
    try:
        return peers.load_trl_bema_callback()
    except peers.PeerUnavailable as err:
        pytest.skip(str(err))
