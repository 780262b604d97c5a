"""_C.tensor_walk / walk_matches and the plan's taker and walk_signature: the walk equals the
reference (and named_modules order) on random module trees, and the check catches every way a model
can stop holding what an update plan was built for, while passing untouched and in-place-updated
models."""

import gc
import sys
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fused_ema import _C
from fused_ema._model.walk import tensor_walk, walk_agrees
from fused_ema._update.plan import taker, walk_signature


def reference_walk(model: nn.Module, with_buffers: bool) -> list:
    out = []
    for module in model.modules():
        out += module._parameters.values()
        if with_buffers:
            skip = module._non_persistent_buffers_set
            out += [b for n, b in module._buffers.items() if n not in skip]
    return out


def same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@st.composite
def module_trees(draw) -> nn.Module:
    """Nested containers and custom leaves with tied parameters, shared submodules, None
    parameters / buffers / children and non-persistent buffers."""
    done: list[nn.Module] = []  # finished subtrees: sharing one never makes a cycle
    params: list[nn.Parameter] = []

    def leaf() -> nn.Module:
        kind = draw(st.sampled_from(["linear", "norm", "custom"]))
        if kind == "linear":
            module = nn.Linear(2, 3, bias=draw(st.booleans()))
        elif kind == "norm":
            module = nn.BatchNorm1d(3)
        else:
            module = nn.Module()
            for k in range(draw(st.integers(0, 3))):
                choice = draw(st.sampled_from(["new", "tied", "none"]))
                if choice == "tied" and params:
                    module.register_parameter(f"p{k}", draw(st.sampled_from(params)))
                elif choice == "none":
                    module.register_parameter(f"p{k}", None)
                else:
                    module.register_parameter(f"p{k}", nn.Parameter(torch.zeros(k + 1)))
            for k in range(draw(st.integers(0, 3))):
                value = None if draw(st.booleans()) else torch.zeros(2)
                module.register_buffer(f"b{k}", value, persistent=draw(st.booleans()))
        params.extend(p for p in module.parameters())
        return module

    def build(depth: int) -> nn.Module:
        if depth == 0 or draw(st.integers(0, 3)) == 0:
            module = draw(st.sampled_from(done)) if done and draw(st.booleans()) else leaf()
        else:
            children = [build(depth - 1) for _ in range(draw(st.integers(0, 4)))]
            kind = draw(st.sampled_from(["seq", "list", "dict", "plain"]))
            if kind == "seq":
                module = nn.Sequential(*children)
            elif kind == "list":
                module = nn.ModuleList(children)
            elif kind == "dict":
                module = nn.ModuleDict({f"m{k}": c for k, c in enumerate(children)})
            else:
                module = nn.Module()
                for k, child in enumerate(children):
                    module.register_module(f"c{k}", child)
                module.register_module("gone", None)
                module.register_buffer("own", torch.ones(1), persistent=draw(st.booleans()))
        done.append(module)
        return module

    return build(draw(st.integers(1, 4)))


@settings(max_examples=60, deadline=None)
@given(model=module_trees(), with_buffers=st.booleans())
def test_walk_equals_python_walk_and_named_modules_order(model, with_buffers):
    walk = _C.tensor_walk(model, with_buffers)
    assert same_objects(walk, tensor_walk(model, with_buffers))
    assert same_objects(walk, reference_walk(model, with_buffers))
    assert same_objects(walk, _C.tensor_walk(model, with_buffers=with_buffers))


def reference_named_walk(model: nn.Module, with_buffers: bool, every_path=False) -> list:
    """(full name, value, is a parameter) from named_modules and each module's own dicts; with
    every_path, along every path to every module, as state_dict() names them."""
    out = []
    for prefix, module in model.named_modules(remove_duplicate=not every_path):
        dot = f"{prefix}." if prefix else ""
        out += [(dot + n, p, True) for n, p in module._parameters.items()]
        if with_buffers:
            skip = module._non_persistent_buffers_set
            out += [(dot + n, b, False) for n, b in module._buffers.items() if n not in skip]
    return out


@settings(max_examples=60, deadline=None)
@given(model=module_trees(), with_buffers=st.booleans())
def test_named_walk_is_the_walk_with_named_modules_names(model, with_buffers):
    from fused_ema._model.walk import named_tensors

    named = _C.named_walk(model, with_buffers)
    expected = reference_named_walk(model, with_buffers)
    assert [(n, k) for n, _, k in named] == [(n, k) for n, _, k in expected]
    assert same_objects([v for _, v, _ in named], [v for _, v, _ in expected])
    assert same_objects([v for _, v, _ in named], _C.tensor_walk(model, with_buffers))
    # What an EMA tracks: each distinct tensor once under its first name, all its names kept.
    tracked = named_tensors(model, with_buffers)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert [t.name for t in tracked if t.kind == "param"] == list(
        dict(model.named_parameters()).keys()
    )
    for t in tracked:
        assert all(
            (params[n] if t.kind == "param" else model.get_buffer(n)) is t.tensor for n in t.names
        )


@settings(max_examples=60, deadline=None)
@given(model=module_trees(), with_buffers=st.booleans())
def test_named_walk_along_every_path_names_what_state_dict_names(model, with_buffers):
    from fused_ema._model.walk import named_tensors

    named = _C.named_walk(model, with_buffers, True)
    expected = reference_named_walk(model, with_buffers, every_path=True)
    assert [(n, k) for n, _, k in named] == [(n, k) for n, _, k in expected]
    assert same_objects([v for _, v, _ in named], [v for _, v, _ in expected])
    # Every name state_dict() gives a tracked tensor is one of its names, the first unchanged.
    tracked = named_tensors(model, with_buffers)
    names = {n: t for t in tracked for n in t.names}
    state = model.state_dict(keep_vars=True)
    for name, value in state.items():
        if value is not None and (with_buffers or name in dict(model.named_parameters())):
            assert names[name].tensor is value, name
    # ... and each tensor's first name is the one the walk of distinct modules gives it.
    first = {}
    for name, value, _ in _C.named_walk(model, with_buffers):
        if value is not None:
            first.setdefault(id(value), name)
    assert [t.name for t in tracked] == [first[id(t.tensor)] for t in tracked]


def test_named_walk_along_every_path_visits_a_cycle_once():
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].add_module("back", model)
    names = [n for n, _, _ in _C.named_walk(model, True, True)]
    assert names == ["0.weight", "0.bias"]


def test_walk_default_keeps_buffers_and_none_entries():
    model = nn.Module()
    model.register_parameter("p", None)
    model.register_buffer("b", None)
    model.register_buffer("hidden", torch.ones(1), persistent=False)
    model.register_module("child", None)
    assert _C.tensor_walk(model) == [None, None]
    assert _C.tensor_walk(model, False) == [None]


def test_walk_handles_cycles_and_deep_nesting():
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].add_module("back", model)  # a cycle: every module is still visited once
    assert same_objects(_C.tensor_walk(model), [model[0].weight, model[0].bias])
    deep = inner = nn.Sequential()
    for _ in range(20_000):  # far past the recursion limit
        child = nn.Sequential()
        inner.append(child)
        inner = child
    inner.append(nn.Linear(1, 1))
    assert same_objects(_C.tensor_walk(deep), [inner[0].weight, inner[0].bias])


class Slotted:
    __slots__ = ()


def test_walk_rejects_objects_that_are_not_modules():
    for root in (object(), Slotted(), 3):
        with pytest.raises(TypeError, match="only torch.nn.Module trees"):
            _C.tensor_walk(root)
    model = nn.Sequential(nn.Linear(1, 1))
    model._modules["odd"] = object()
    with pytest.raises(TypeError, match="only torch.nn.Module trees"):
        _C.tensor_walk(model)


def test_walk_keeps_no_references():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    weight = model[0].weight
    before = sys.getrefcount(weight), sys.getrefcount(model), sys.getrefcount(model[1])
    walk = _C.tensor_walk(model)
    snap = refs(walk)
    del walk
    for _ in range(1_000):
        walk = _C.tensor_walk(model)
        assert _C.walk_matches(walk, snap)
    del walk
    assert (sys.getrefcount(weight), sys.getrefcount(model), sys.getrefcount(model[1])) == before
    probe = weakref.ref(model)
    del model, weight
    gc.collect()
    assert probe() is None


def refs(walk: list) -> tuple:
    return tuple(None if t is None else weakref.ref(t) for t in walk)


class Checked:
    """A model's walk remembered as an update plan would keep it: weakrefs and a signature."""

    def __init__(self, model: nn.Module, with_buffers: bool = True):
        self.with_buffers = with_buffers
        walk = _C.tensor_walk(model, with_buffers)
        self.refs, self.signature = refs(walk), walk_signature(walk)

    def matches(self, model: nn.Module) -> bool:
        """Binding.plan_for's walk_matches and same_tensors: the same objects, same tensors."""
        walk = _C.tensor_walk(model, self.with_buffers)
        return _C.walk_matches(walk, self.refs) and walk_signature(walk) == self.signature


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 2), nn.BatchNorm1d(2)]))


def test_untouched_and_updated_in_place_models_match():
    model = net()
    checked = Checked(model)
    assert checked.matches(model) and checked.matches(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        x = model[0](torch.randn(3, 4))
        model[1][1](model[1][0](x)).square().sum().backward()  # BatchNorm updates its buffers
        opt.step()
        opt.zero_grad()
    assert checked.matches(model)
    model.insert(1, nn.ReLU())  # a module without tensors changes nothing an update reads
    assert checked.matches(model)


def test_replaced_parameter_of_same_shape_is_caught():
    model = net()
    checked = Checked(model)
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    assert not checked.matches(model)


def test_replacement_at_the_dead_objects_address_is_caught():
    model = net()
    checked = Checked(model)
    old_id, data = id(model[1][0].weight), torch.zeros(model[1][0].weight.shape)
    model[1][0]._parameters["weight"] = None
    gc.collect()
    candidates = []
    for _ in range(10_000):  # each allocates little else, so the freed slot comes back soon
        candidates.append(nn.Parameter(data))
        if id(candidates[-1]) == old_id:
            break
    else:
        pytest.skip("no new parameter landed at the dead one's address")
    model[1][0].weight = candidates[-1]
    assert checked.refs[2]() is None  # the plan's weakref died with the old object
    assert walk_signature(_C.tensor_walk(model)) == checked.signature
    assert not checked.matches(model)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: m.half(), id="dtype"),
        pytest.param(lambda m: m.to("meta"), id="device"),
        pytest.param(lambda m: m[1][1].running_mean.resize_(5), id="resize_"),
        pytest.param(lambda m: m.insert(1, nn.Linear(4, 4)), id="inserted module"),
        pytest.param(lambda m: m.pop(1), id="removed module"),
        pytest.param(lambda m: m[0].register_buffer("extra", torch.ones(1)), id="buffer added"),
        pytest.param(lambda m: m[0].register_parameter("bias", None), id="parameter now None"),
    ],
)
def test_model_changes_are_caught(change):
    model = net()
    checked = Checked(model)
    change(model)
    assert not checked.matches(model)


def test_buffers_are_ignored_without_with_buffers():
    model = net()
    checked = Checked(model, with_buffers=False)
    model[0].register_buffer("extra", torch.ones(1))
    assert checked.matches(model)
    model[0].register_parameter("extra_p", nn.Parameter(torch.ones(1)))
    assert not checked.matches(model)


def test_signature_describes_type_dtype_device_and_shape():
    t = torch.zeros(2, 3)
    sig = walk_signature
    assert sig([t, None]) == sig([torch.ones(2, 3), None])
    assert sig([]) == []
    for other in (
        [nn.Parameter(t), None],
        [t.double(), None],
        [t.to("meta"), None],
        [t.view(3, 2), None],
        [t.view(6), None],
        [None, t],
        [t, t],
        [t.to_sparse(), None],
    ):
        assert sig(other) != sig([t, None])


def test_walk_matches_rejects_bad_lengths_and_arguments():
    walk = [torch.zeros(2), None]
    good = refs(walk)
    assert _C.walk_matches(walk, good)
    assert not _C.walk_matches(walk, good[:1])
    assert not _C.walk_matches(walk, (None, None))
    assert not _C.walk_matches([torch.zeros(2), None], good)
    with pytest.raises(TypeError, match="weakref"):
        _C.walk_matches(walk, (walk[0], None))
    with pytest.raises(TypeError, match="tuple"):
        _C.walk_matches(walk, list(good))
    with pytest.raises(TypeError):
        _C.walk_matches(walk, good, b"")


def test_taker_indexes_and_checks_bounds():
    walk = [torch.zeros(1), None, torch.ones(1)]
    assert same_objects(taker((2, 0, 1, 2, -1))(walk), [walk[2], walk[0], None, walk[2], walk[2]])
    assert same_objects(taker((2,))(walk), [walk[2]])  # one index: still a list
    for bad in ((3,), (0, -4)):
        with pytest.raises(IndexError, match="out of range"):
            taker(bad)(walk)


@settings(max_examples=40, deadline=None)
@given(model=module_trees(), with_buffers=st.booleans(), data=st.data())
def test_walk_agrees_item_by_item_whatever_the_tensor_type(model, with_buffers, data):
    # What a compiled update checks its traced values with: plain tensors of the walk's dtypes,
    # devices and shapes agree; any one item off (shape, dtype, None, one item more or less)
    # does not.
    walk = _C.tensor_walk(model, with_buffers)
    plain = [None if t is None else t.detach().clone() for t in walk]
    assert walk_agrees(plain, walk)
    assert walk_agrees(tensor_walk(model, with_buffers), walk)
    assert not walk_agrees(plain + [torch.zeros(1)], walk)
    tensors = [i for i, t in enumerate(walk) if t is not None]
    if not tensors:
        return
    i = data.draw(st.sampled_from(tensors))
    change = data.draw(st.sampled_from(["reshape", "dtype", "none", "drop"]))
    off = list(plain)
    if change == "reshape":
        off[i] = torch.zeros(*walk[i].shape, 2)
    elif change == "dtype":
        off[i] = walk[i].detach().double()
    elif change == "none":
        off[i] = None
    else:
        del off[i]
    assert not walk_agrees(off, walk)
