"""Access to the EMA code fused_ema is compared with, shared by the tests and the benchmarks.

timm: only `timm/utils/model_ema.py` is loaded, straight from the installed package's files under
a private module name. `import timm` would run timm's package `__init__`, which imports
torchvision, and torchvision often has no build that loads against the torch in use (for torch
2.13 only a CUDA build exists, which fails against the CPU torch). model_ema.py itself needs only
torch, so this is the real ModelEmaV3 and the real `_lerp_stochastic_round_bf16_`.

The migration peers (ema-pytorch, torch_ema, diffusers, Lightning) are imported normally; each
load_* function raises PeerUnavailable saying why one cannot be used and how to install it.

Also here: whether the planned stochastic-rounding API of fused_ema exists yet
(`fused_ema.lerp_stochastic_`, and ModelEma's `stochastic_rounding=` and
`stochastic_rounding_seed=` keywords), so every user skips with the same reason until it lands.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

import fused_ema

TIMM_VERSION = "1.0.31"  # the version .ci/env.sh installs (with --no-deps)
TRL_VERSION = "1.16.0"  # likewise (with --no-deps, then datasets, pandas, pyarrow)
TRL_INSTALL = (
    f"pip install --no-deps trl=={TRL_VERSION} && pip install datasets==5.2.0 pandas pyarrow"
)
_TIMM_MODULE_NAME = "_fused_ema_peers_timm_model_ema"


class PeerUnavailable(ImportError):
    """A compared library (or a planned fused_ema API) is not there; the message says why."""


def timm_version() -> str | None:
    try:
        return importlib.metadata.version("timm")
    except importlib.metadata.PackageNotFoundError:
        return None


def load_timm_model_ema() -> ModuleType:
    """The installed timm's `timm.utils.model_ema` module, without importing the timm package.

    Raises PeerUnavailable, saying why, when timm is not installed or its file is missing."""
    cached = sys.modules.get(_TIMM_MODULE_NAME)
    if cached is not None:
        return cached
    spec = importlib.util.find_spec("timm")  # locates the package; does not run its __init__
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable(
            f"timm is not installed (.ci/env.sh installs timm=={TIMM_VERSION} with --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "model_ema.py"
    if not path.is_file():
        raise PeerUnavailable(f"timm {timm_version()} has no {path}")
    module_spec = importlib.util.spec_from_file_location(_TIMM_MODULE_NAME, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[_TIMM_MODULE_NAME] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[_TIMM_MODULE_NAME]
        raise PeerUnavailable(f"cannot load {path}: {type(err).__name__}: {err}") from err
    if not hasattr(module, "ModelEmaV3"):
        del sys.modules[_TIMM_MODULE_NAME]
        raise PeerUnavailable(f"timm {timm_version()} has no ModelEmaV3 in {path}")
    return module


def timm_missing(*, stochastic_rounding: bool = False) -> str | None:
    """Why timm's ModelEmaV3 (with stochastic rounding, if asked) cannot be used, or None."""
    try:
        module = load_timm_model_ema()
    except PeerUnavailable as err:
        return str(err)
    if stochastic_rounding and not hasattr(module, "_lerp_stochastic_round_bf16_"):
        return f"timm {timm_version()} has no stochastic rounding (needs timm>={TIMM_VERSION})"
    return None


def fused_stochastic_missing() -> str | None:
    """Why `fused_ema.lerp_stochastic_` cannot be used yet, or None."""
    if not hasattr(fused_ema, "lerp_stochastic_"):
        return "pending: fused_ema.lerp_stochastic_ is not implemented yet"
    return None


def model_ema_stochastic_missing() -> str | None:
    """Why `fused_ema.ModelEma(..., stochastic_rounding=True, stochastic_rounding_seed=0)`
    cannot be used yet, or None."""
    parameters = inspect.signature(fused_ema.ModelEma).parameters
    missing = [
        k for k in ("stochastic_rounding", "stochastic_rounding_seed") if k not in parameters
    ]
    if missing:
        return f"pending: fused_ema.ModelEma has no {', '.join(missing)} keyword yet"
    return None


# ---------------------------------------------------------------------- migration peers


def _import(module: str, package: str, install: str):
    try:
        return importlib.import_module(module)
    except Exception as err:  # missing, or broken by a dependency (e.g. torchvision)
        raise PeerUnavailable(
            f"{package} is not usable: cannot import {module} ({type(err).__name__}: {err}); "
            f"install it with `{install}`"
        ) from err


def load_ema_pytorch() -> ModuleType:
    """ema_pytorch (its EMA class)."""
    return _import("ema_pytorch", "ema-pytorch", "pip install --no-deps ema-pytorch")


def load_torch_ema() -> ModuleType:
    """torch_ema (its ExponentialMovingAverage)."""
    return _import("torch_ema", "torch-ema", "pip install --no-deps torch-ema")


def load_diffusers() -> ModuleType:
    """diffusers.training_utils (EMAModel), with diffusers.ModelMixin and ConfigMixin reachable
    from it as `module.ModelMixin`, `module.ConfigMixin`, `module.register_to_config`."""
    install = "pip install --no-deps diffusers==0.42.1 huggingface-hub safetensors regex"
    module = _import("diffusers.training_utils", "diffusers", install)
    configuration = _import("diffusers.configuration_utils", "diffusers", install)
    modeling = _import("diffusers.models.modeling_utils", "diffusers", install)
    module.ConfigMixin = configuration.ConfigMixin
    module.register_to_config = configuration.register_to_config
    module.ModelMixin = modeling.ModelMixin
    return module


def load_lightning() -> ModuleType:
    """lightning.pytorch, with its EMAWeightAveraging callback (Lightning >= 2.6)."""
    install = "pip install --no-deps lightning lightning-utilities torchmetrics"
    module = _import("lightning.pytorch", "lightning", install)
    callbacks = _import("lightning.pytorch.callbacks", "lightning", install)
    if not hasattr(callbacks, "EMAWeightAveraging"):
        raise PeerUnavailable(f"lightning {module.__version__} has no EMAWeightAveraging")
    return module


def load_trl_bema_callback() -> type:
    """TRL's BEMACallback class (trl.trainer.callbacks, the module `from trl import BEMACallback`
    loads), the reference of fused_ema.Bema. Importing it needs trl, accelerate, transformers,
    datasets, pandas and pyarrow; none of them pulls a torch of its own when trl goes in with
    --no-deps."""
    module = _import("trl.trainer.callbacks", f"trl (TRL {TRL_VERSION})", TRL_INSTALL)
    if not hasattr(module, "BEMACallback"):
        found = importlib.metadata.version("trl")
        raise PeerUnavailable(f"trl {found} has no BEMACallback (needs trl=={TRL_VERSION})")
    return module.BEMACallback
