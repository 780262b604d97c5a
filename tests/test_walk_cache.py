"""_C.walk_cache / walk_unchanged and the update path that uses them: after every kind of change
to a model the cache answers None (and the update walks the model again) or, where the model holds
the same objects, the plan's tensor check refuses its walk; never a walk that differs from
tensor_walk's. An untouched or in-place-updated model keeps being confirmed without a walk, and
a ModelEma that uses the cache behaves bit for bit like one that walks every time."""

import contextlib
import copy
import gc
import sys
import weakref
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fused_ema
from fused_ema import _C
from fused_ema._update import plan as _plan
from fused_ema._update.plan import walk_signature

# The cache watches dicts with CPython's dict watchers (3.12+); older Pythons walk every update,
# and the structure-change tests of the update itself (tests/test_ema_structure.py and the
# ModelEma tests below) run there too.
needs_cache = pytest.mark.skipif(
    sys.version_info < (3, 12), reason="the walk cache needs dict watchers (Python 3.12+)"
)


class Custom(nn.Module):
    """A parameter tied to another module's and a non-persistent buffer."""

    def __init__(self, tied: nn.Parameter):
        super().__init__()
        self.tied = tied
        self.register_buffer("scratch", torch.randn(3), persistent=False)
        self.register_buffer("kept", torch.randn(3))


def net() -> nn.Module:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(
        shared, nn.ModuleList([nn.Linear(4, 2), nn.BatchNorm1d(2)]), shared, Custom(shared.bias)
    )
    model.train()
    return model


def same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def new_param(p: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(p.detach().clone() + torch.randn_like(p))


# Changes to a model, each applied to the net above. "structural" ones change what the walk finds
# (its objects, their order, or an item's signature); confirmed() must answer None after them.
STRUCTURAL = {
    "setattr parameter": lambda m: setattr(m[0], "weight", new_param(m[0].weight)),
    "register_parameter": lambda m: m[1][0].register_parameter("extra", new_param(torch.ones(3))),
    "del parameter": lambda m: delattr(m[1][0], "bias"),
    "parameter set to None": lambda m: m[1][0].register_parameter("bias", None),
    "_parameters dict write": lambda m: m[1][0]._parameters.__setitem__(
        "weight", new_param(m[1][0].weight)
    ),
    "_parameters reordered": lambda m: m[1][0]._parameters.__setitem__(
        "weight", m[1][0]._parameters.pop("weight")
    ),
    "_parameters dict replaced": lambda m: setattr(
        m[1][0], "_parameters", {"weight": new_param(m[1][0].weight)}
    ),
    "buffer reassigned": lambda m: setattr(m[1][1], "running_mean", torch.randn(2)),
    "buffer registered": lambda m: m[0].register_buffer("extra", torch.randn(2)),
    "buffer made non-persistent in place": lambda m: m[3]._non_persistent_buffers_set.add("kept"),
    "buffer made persistent in place": lambda m: m[3]._non_persistent_buffers_set.discard(
        "scratch"
    ),
    "module inserted": lambda m: m.insert(1, nn.Linear(4, 4)),
    "module removed": lambda m: m[1].__delitem__(0),
    "module replaced": lambda m: m.__setitem__(3, nn.Linear(4, 4)),
    "module renamed": lambda m: m._modules.__setitem__("renamed", m._modules.pop("1")),
    "module set to None": lambda m: m[1]._modules.__setitem__("1", None),
    "tie undone": lambda m: setattr(m[3], "tied", new_param(m[3].tied)),
    "model.double()": lambda m: m.double(),
    "model.to(meta)": lambda m: m.to("meta"),
    ".data = reshaped": lambda m: setattr(m[1][0].weight, "data", torch.randn(3, 4)),
    ".data = float64": lambda m: setattr(m[1][0].weight, "data", m[1][0].weight.data.double()),
    "resize_ of a buffer": lambda m: m[1][1].running_var.resize_(5),
    "num_batches_tracked resize_": lambda m: m[1][1].num_batches_tracked.resize_(1),
    "__class__ of a parameter": lambda m: setattr(m[1][0].weight, "__class__", torch.Tensor),
}

# Changes after which the walk finds the same objects with the same signatures.
HARMLESS = {
    "nothing": lambda m: None,
    "eval()": lambda m: m.eval(),
    "attribute set": lambda m: setattr(m[1][0], "note", object()),
    "in-place update": lambda m: [p.data.add_(1) for p in m.parameters()],
    ".data = same shape": lambda m: setattr(m[0].weight, "data", torch.randn(4, 4)),
    "tensorless module added to __dict__": lambda m: object.__setattr__(m, "helper", nn.ReLU()),
}


def cached(model: nn.Module, with_buffers: bool = True):
    walk = _C.tensor_walk(model, with_buffers)
    cache = _C.walk_cache(model, with_buffers, walk)
    assert cache is not None
    return cache, walk, walk_signature(walk)


def confirmed(cache, model: nn.Module, signature: list):
    """What an update takes for the model's walk without walking it: the cache's, if its tensors
    keep the signature the plan was built for (UpdatePlan.same_tensors)."""
    got = _C.walk_unchanged(cache, model)
    return got if got is not None and walk_signature(got) == signature else None


@needs_cache
@pytest.mark.parametrize("with_buffers", [True, False])
@pytest.mark.parametrize("change", list(HARMLESS), ids=str)
def test_unchanged_models_are_confirmed_without_a_walk(change, with_buffers):
    model = net()
    cache, walk, signature = cached(model, with_buffers)
    HARMLESS[change](model)
    for _ in range(2):
        got = _C.walk_unchanged(cache, model)
        assert got is not None and got is not walk
        assert same_objects(got, walk) and same_objects(got, _C.tensor_walk(model, with_buffers))
        assert walk_signature(got) == signature


@needs_cache
@pytest.mark.parametrize("change", list(STRUCTURAL), ids=str)
def test_every_structure_change_is_caught(change):
    model = net()
    cache, walk, signature = cached(model)
    assert confirmed(cache, model, signature) is not None
    STRUCTURAL[change](model)
    now = _C.tensor_walk(model)
    assert not (same_objects(now, walk) and walk_signature(now) == signature)  # it did change
    assert confirmed(cache, model, signature) is None
    assert confirmed(cache, model, signature) is None


@needs_cache
def test_buffer_changes_are_not_looked_at_without_buffers():
    model = net()
    cache, walk, _ = cached(model, with_buffers=False)
    model[0].register_buffer("extra", torch.randn(2))
    model[1][1].running_var.resize_(5)
    got = _C.walk_unchanged(cache, model)
    assert got is not None and same_objects(got, walk)
    model[0].register_parameter("extra_p", new_param(torch.ones(2)))
    assert _C.walk_unchanged(cache, model) is None


@needs_cache
def test_another_model_of_the_same_structure_is_not_taken_for_it():
    cache, _, _ = cached(net())
    twin = net()
    assert _C.walk_unchanged(cache, twin) is None
    assert _C.walk_unchanged(cache, twin[1]) is None


@needs_cache
def test_cache_keeps_no_references():
    model = net()
    probes = [weakref.ref(model)] + [weakref.ref(p) for p in model.parameters()]
    cache, walk, _ = cached(model)
    del walk, model
    assert all(probe() is None for probe in probes)
    assert _C.walk_unchanged(cache, net()) is None


@needs_cache
def test_a_walk_that_is_not_the_models_gets_no_cache():
    model = net()
    walk = _C.tensor_walk(model)
    assert _C.walk_cache(model, True, walk[:-1]) is None
    assert _C.walk_cache(model, True, walk[::-1]) is None
    assert _C.walk_cache(model, False, walk) is None  # that one was walked with buffers


@needs_cache
def test_dicts_that_could_run_python_code_get_no_cache():
    class Params(dict):
        pass

    model = net()
    model[1][0]._parameters = Params(model[1][0]._parameters)
    assert _C.walk_cache(model, True, _C.tensor_walk(model)) is None
    model = net()
    model[3]._buffers[7] = torch.ones(1)  # a name that is not a str: the set lookup hashes it
    assert _C.walk_cache(model, True, _C.tensor_walk(model)) is None


@needs_cache
def test_bad_arguments_are_refused():
    with pytest.raises(TypeError):
        _C.walk_cache(net(), True)
    with pytest.raises(TypeError):
        _C.walk_cache(net(), True, ())
    with pytest.raises((TypeError, ValueError)):
        _C.walk_unchanged(object(), net())


@settings(max_examples=80, deadline=None)
@given(
    changes=st.lists(
        st.sampled_from(sorted(set(STRUCTURAL) | set(HARMLESS)) + ["refresh"]), max_size=6
    ),
    with_buffers=st.booleans(),
)
@needs_cache
def test_a_confirmed_walk_is_always_the_models_walk(changes, with_buffers):
    """Whatever happened to the model, a walk the cache gives is tensor_walk's, object for
    object, with the signature the cache was built for."""
    model = net()
    cache, walk, signature = cached(model, with_buffers)
    for change in changes:
        if change == "refresh":
            walk = _C.tensor_walk(model, with_buffers)
            cache = _C.walk_cache(model, with_buffers, walk)
            signature = walk_signature(walk)
            if cache is None:
                return
            continue
        with contextlib.suppress(Exception):  # some changes do not apply after others
            (STRUCTURAL.get(change) or HARMLESS[change])(model)
        got = confirmed(cache, model, signature)
        now = _C.tensor_walk(model, with_buffers)
        if got is not None:  # the cache may give up after a harmless change, never the reverse
            assert same_objects(got, now) and same_objects(got, walk)
            assert walk_signature(now) == signature


# ---------------------------------------------------------------------- through ModelEma


@contextlib.contextmanager
def no_walk_cache():
    with mock.patch.object(_plan.UpdatePlan, "remember", lambda *args: None):
        yield


def state(ema) -> dict:
    sd = ema.state_dict()
    return {"step": sd["step"].item(), **{k: v.clone() for k, v in sd["weights"].items()}}


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def update(ema, model):
    """ema.update(model): the exception type and message it raised, or None."""
    try:
        ema.update(model)
    except Exception as err:  # noqa: BLE001  (compared between the two paths)
        return type(err), str(err)
    return None


@needs_cache
@pytest.mark.parametrize("on_mismatch", ["error", "resync"])
@pytest.mark.parametrize("change", list(STRUCTURAL) + list(HARMLESS), ids=str)
def test_model_ema_with_the_cache_behaves_as_without(change, on_mismatch):
    if change == "model.to(meta)":
        pytest.skip("a meta model holds no values to average")
    model = net()
    cached_ema = fused_ema.ModelEma(model, 0.9, on_mismatch=on_mismatch)
    walking_ema = copy.deepcopy(cached_ema)
    for _ in range(2):
        cached_ema.update(model)
        with no_walk_cache():
            walking_ema.update(model)
    assert cached_ema._binding.plan.unchanged_walk(model) is not None  # the cache is in use
    assert walking_ema._binding.plan.unchanged_walk(model) is None
    before = state(cached_ema)
    with torch.no_grad():
        STRUCTURAL.get(change, HARMLESS.get(change))(model)
    if change in STRUCTURAL:  # the cache gives up, or the plan refuses the tensors it finds
        plan = cached_ema._binding.plan
        walk = plan.unchanged_walk(model)
        assert walk is None or not plan.same_tensors(walk)
    for _ in range(2):
        outcome = update(cached_ema, model)
        with no_walk_cache():
            assert update(walking_ema, model) == outcome
        assert_same_state(state(cached_ema), state(walking_ema))
        assert cached_ema.names() == walking_ema.names()
    if outcome is not None:
        assert outcome[0] is fused_ema.StructureMismatchError and on_mismatch == "error"
        assert_same_state(state(cached_ema), before)  # nothing written


@needs_cache
def test_model_ema_values_after_a_cached_update_follow_the_reference():
    """Independent of the other path: each averaged entry moves by (1 - decay) toward the
    model's current tensor, computed in float64, on updates that take the cache."""
    model = net()
    ema = fused_ema.ModelEma(model, 0.75)
    ema.update(model)
    for k in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
            model[0].weight.data = torch.randn(4, 4)  # same signature: the cache still holds
        assert ema._binding.plan.unchanged_walk(model) is not None
        before = {k: v.double() for k, v in ema.state_dict()["weights"].items()}
        ema.update(model)
        after = ema.state_dict()["weights"]
        current = model.state_dict()
        for name, value in after.items():
            if value.is_floating_point():
                expected = before[name] + 0.25 * (current[name].double() - before[name])
                torch.testing.assert_close(value.double(), expected, rtol=0, atol=1e-6)
            else:
                assert torch.equal(value, current[name])


@needs_cache
def test_non_blocking_plan_keeps_its_own_walk():
    model = net()
    ema = fused_ema.ModelEma(model, 0.5, device="cpu")
    ema.update(model)
    ema.update(model, non_blocking=True)
    ema.synchronize()
    ema.update(model)
    reference = fused_ema.ModelEma(model, 0.5, device="cpu")
    with no_walk_cache():
        for non_blocking in (False, True, False):
            reference.update(model, non_blocking=non_blocking)
            reference.synchronize()
    assert_same_state(state(ema), state(reference))


# ---------------------------------------------------------------------- unwrapping, per update


def reference_unwrap(model: nn.Module) -> nn.Module:
    """unwrap_model as it was: getattr, whatever raising AttributeError costs."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


class WithProperty(nn.Module):
    @property
    def _orig_mod(self):
        return self.inner

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)


class WithGetattr(nn.Module):
    def __getattr__(self, name):
        if name == "_orig_mod":
            return nn.Linear(2, 2)
        return super().__getattr__(name)


def wrappers():
    plain = nn.Linear(2, 2)
    as_child = nn.Module()
    as_child._orig_mod = nn.Linear(2, 2)  # nn.Module.__setattr__: a submodule
    as_attribute = nn.Module()
    object.__setattr__(as_attribute, "_orig_mod", nn.Linear(2, 2))
    as_tensor = nn.Module()
    as_tensor.register_buffer("_orig_mod", torch.ones(1))
    nested = nn.DataParallel(torch.compile(nn.DataParallel(nn.Linear(2, 2))))
    return [plain, as_child, as_attribute, as_tensor, WithProperty(), WithGetattr(), nested]


@pytest.mark.parametrize("index", range(len(wrappers())))
def test_unwrap_model_finds_what_getattr_finds(index):
    from fused_ema._model.walk import unwrap_model

    model = wrappers()[index]
    got = unwrap_model(model)
    expected = reference_unwrap(model)
    if isinstance(model, WithGetattr):  # it makes a new module each time
        assert type(got) is type(expected) is nn.Linear
    else:
        assert got is expected


@needs_cache
@pytest.mark.parametrize("change", ["_parameters dict write", "module renamed", "model.double()"])
def test_a_dropped_cache_leaves_another_on_the_same_model_watching(change):
    """Two caches (two EMAs of one model) watch the same dicts: dropping one must not stop the
    other from seeing a change, and a cache dropped after its model died unwatches nothing live."""
    model = net()
    first, walk, _ = cached(model)
    second, _, _ = cached(model)
    del first
    gc.collect()
    assert same_objects(_C.walk_unchanged(second, model), walk)
    STRUCTURAL[change](model)
    assert _C.walk_unchanged(second, model) is None
    third, _, _ = cached(model)
    del model
    gc.collect()
    del third, second  # their dicts are gone: nothing to unwatch
    fresh = net()
    cache, walk, _ = cached(fresh)
    STRUCTURAL[change](fresh)
    assert _C.walk_unchanged(cache, fresh) is None
