"""Name filters: copy_names (copied from the model, not averaged) and ignore_names (left out), by
exact name, module name or glob, with ema-pytorch's spellings as aliases; against the real
ema-pytorch, and through structure checks and checkpoints."""

import copy

import pytest
import torch
from torch import nn

import fused_ema
from benchmarks import peers as peer_access
from ema_helpers import TiedNet, small_mlp, train_step
from peers import peer


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8))
        self.encoder_extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.pos_embed = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return self.head(self.encoder_extra(self.encoder(x) + self.pos_embed))


def rules(ema):
    """name -> "average" / "copy" for every entry of the EMA."""
    return {
        n: "average" if e.average else "copy" for e in ema._binding.table.entries for n in e.names
    }


def trained(model, steps, seed):
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        train_step(model, opt, g)
        yield


ALL = [
    "encoder.0.weight",
    "encoder.0.bias",
    "encoder.1.weight",
    "encoder.1.bias",
    "encoder_extra.weight",
    "encoder_extra.bias",
    "head.weight",
    "head.bias",
    "pos_embed",
]


@pytest.mark.parametrize(
    "kwargs, copied, left_out",
    [
        (dict(copy_names="pos_embed"), ["pos_embed"], []),
        (dict(copy_names=["encoder"]), ALL[:4], []),  # a module name: not encoder_extra
        (dict(ignore_names=["encoder.*.bias"]), [], ["encoder.0.bias", "encoder.1.bias"]),
        (dict(ignore_names=["*bias"], copy_names=["head"]), ["head.weight"], ALL[1:9:2]),
        (dict(ignore_startswith_names={"encoder"}), [], ALL[:6]),  # a string prefix
        (dict(param_or_buffer_names_no_ema={"head.bias"}), ["head.bias"], []),
        (dict(ignore_names=["head.weight"], copy_names=["head.weight"]), [], ["head.weight"]),
        (dict(copy_names=["encoder.[01].weight"]), ["encoder.0.weight", "encoder.1.weight"], []),
    ],
)
def test_patterns_choose_copy_or_leave_out(kwargs, copied, left_out):
    ema = fused_ema.ModelEma(Nested(), 0.9, **kwargs)
    got = rules(ema)
    assert sorted(got) == sorted(set(ALL) - set(left_out))
    assert sorted(n for n, r in got.items() if r == "copy") == sorted(copied)
    assert sorted(ema.state_dict()["weights"]) == sorted(got)


def test_copied_tensors_follow_the_model_and_the_rest_averages():
    torch.manual_seed(0)
    model = Nested()
    ema = fused_ema.ModelEma(model, 0.9, copy_names=["head"], ignore_names=["pos_embed"])
    reference = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    first_pos = model.pos_embed.detach().clone()
    for k, _ in enumerate(trained(model, 12, seed=1)):
        ema.update(model)
        for n, p in model.named_parameters():
            w = 1.0 if k == 0 else 0.1
            reference[n] += w * (p.detach().double() - reference[n])
    weights = ema.state_dict()["weights"]
    assert "pos_embed" not in weights and "pos_embed" not in ema.names()
    assert torch.equal(weights["head.weight"], model.head.weight)
    assert torch.equal(weights["head.bias"], model.head.bias)
    for n in ALL[:6]:
        torch.testing.assert_close(weights[n].double(), reference[n], rtol=1e-6, atol=1e-7)
    # evaluation and copy_to leave the ignored tensor to the model
    target = Nested()
    before = target.pos_embed.detach().clone()
    ema.copy_to(target)
    assert torch.equal(target.pos_embed, before) and not torch.equal(before, first_pos)
    assert torch.equal(target.encoder[0].weight, weights["encoder.0.weight"])


def test_equals_ema_pytorch_with_its_spellings():
    ema_pytorch = peer(peer_access.load_ema_pytorch)
    torch.manual_seed(2)
    model = small_mlp()
    filters = dict(
        param_or_buffer_names_no_ema={"3.bias", "1.running_mean"},
        ignore_names={"0.bias"},
        ignore_startswith_names={"1.w"},
    )
    theirs = ema_pytorch.EMA(
        model, beta=0.99, update_after_step=3, update_every=1, include_online_model=False, **filters
    )
    ours = fused_ema.ModelEma(model, 0.99, warmup=True, update_after_step=3, **filters)
    assert set(ours.names()) == {n for n, _ in model.state_dict().items()} - {"0.bias", "1.weight"}
    for _ in trained(model, 40, seed=3):
        theirs.update()
        ours.update(model)
    weights = ours.state_dict()["weights"]
    for name, expected in theirs.ema_model.state_dict().items():
        if name in ("0.bias", "1.weight"):
            assert name not in weights  # ema-pytorch freezes them after its copy steps
        elif expected.is_floating_point():
            torch.testing.assert_close(weights[name], expected, rtol=2e-6, atol=1e-7, msg=name)
    assert torch.equal(weights["3.bias"], model[3].bias)
    assert torch.equal(weights["1.running_mean"], model[1].running_mean)


def test_a_tied_weight_follows_any_of_its_names():
    ema = fused_ema.ModelEma(TiedNet(), 0.9, copy_names=["head.weight"])
    assert rules(ema)["embed.weight"] == rules(ema)["head.weight"] == "copy"
    ema = fused_ema.ModelEma(TiedNet(), 0.9, ignore_names=["head"])
    assert "embed.weight" not in ema.names() and "head.weight" not in ema.names()


@pytest.mark.filterwarnings("ignore:.*match no parameter")  # "2": not before the rename
@pytest.mark.parametrize("resync", ["on_mismatch", "explicit"])
@pytest.mark.parametrize("pattern", ["1", "2"])
def test_a_followed_rename_applies_copy_names_to_the_present_names(pattern, resync):
    """A module inserted in front renames the layers after it (0.* -> 1.*, 1.* -> 2.*):
    copy_names rules them by the names they carry now, as in a new EMA of the model. Renamed into
    the pattern: copied from then on; out of it: averaged, from the model's value at the resync."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mode = "resync" if resync == "on_mismatch" else "error"
    ema = fused_ema.ModelEma(model, 0.9, copy_names=[pattern], on_mismatch=mode)
    for _ in range(3):
        trained(model, 1, seed=4)
        ema.update(model)
    model.insert(0, nn.Linear(4, 4))
    if resync == "explicit":
        ema.resync(model)
    at_resync = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained(model, 2, seed=5)
    ema.update(model)
    assert rules(ema) == rules(fused_ema.ModelEma(model, 0.9, copy_names=[pattern]))
    weights = ema.state_dict()["weights"]
    for name, p in model.named_parameters():
        if name.startswith(pattern + "."):  # renamed into the pattern (1.* was averaged as 0.*)
            assert torch.equal(weights[name], p.detach()), name
    if pattern == "1":  # 2.* was copied as 1.*: averaged now, from the model's value at the resync
        start = at_resync if resync == "explicit" else dict(model.named_parameters())
        for name in ("2.weight", "2.bias"):
            want = start[name].detach() + 0.1 * (model.get_parameter(name).detach() - start[name])
            torch.testing.assert_close(weights[name], want, rtol=0, atol=1e-6)


def test_structure_checks_respect_the_filters():
    model = Nested()
    with pytest.warns(UserWarning, match="match no parameter"):  # not yet: they come later
        ema = fused_ema.ModelEma(
            model, 0.9, ignore_names=["extra*", "pos_embed"], copy_names=["new"]
        )
    model.pos_embed = nn.Parameter(torch.randn(8))  # replaced, but left out
    model.extra_head = nn.Linear(4, 4)  # added, but left out
    ema.update(model)
    assert "extra_head.weight" not in ema.names()
    model.new = nn.Linear(2, 2)
    with pytest.raises(fused_ema.StructureMismatchError, match=r"new\.weight"):
        ema.update(model)
    ema.resync(model)
    assert rules(ema)["new.weight"] == "copy" and rules(ema)["head.weight"] == "average"


def test_checkpoints_carry_the_filters_and_refuse_others():
    torch.manual_seed(4)
    model = Nested()
    saved = fused_ema.ModelEma(model, 0.9, copy_names=["head"], ignore_names=["pos_embed"])
    for _ in trained(model, 3, seed=5):
        saved.update(model)
    state = saved.state_dict()
    assert state["filters"] == {"copy_names": ["head"], "ignore_names": ["pos_embed"]}
    same = fused_ema.ModelEma(Nested(), 0.9, copy_names="head", ignore_names="pos_embed")
    same.load_state_dict(state)
    assert same.step == saved.step
    other = fused_ema.ModelEma(Nested(), 0.9, ignore_names=["pos_embed"])
    before = other.state_dict()
    with pytest.raises(fused_ema.CheckpointError, match=r"saved with copy_names=\['head'\]"):
        other.load_state_dict(state)
    after = other.state_dict()
    assert after["step"] == before["step"]
    assert all(torch.equal(after["weights"][k], v) for k, v in before["weights"].items())
    result = other.load_state_dict(state, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(other.state_dict()["weights"]["head.bias"], state["weights"]["head.bias"])


def test_ignored_names_in_a_peer_checkpoint_are_skipped():
    model = Nested()
    full = {k: v + 1 for k, v in model.state_dict().items()}  # e.g. an ema-pytorch ema_model
    ema = fused_ema.ModelEma(model, 0.9, ignore_names=["pos_embed"])
    result = ema.load_state_dict(full)  # strict: pos_embed is neither loaded nor unexpected
    assert result.unexpected_keys == []
    assert torch.equal(ema.state_dict()["weights"]["head.bias"], full["head.bias"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(copy_names=[""]), "copy_names must hold non-empty strings"),
        (dict(ignore_names=[3]), r"ignore_names must hold non-empty strings \(.*\), got int 3"),
        (dict(ignore_names=7), "ignore_names must be a name"),
        (dict(param_or_buffer_names_no_ema=[None]), "param_or_buffer_names_no_ema must hold"),
        (dict(ignore_startswith_names=[b"x"]), "ignore_startswith_names must hold"),
    ],
)
def test_bad_patterns_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fused_ema.ModelEma(Nested(), 0.9, **kwargs)


def test_a_pattern_that_matches_nothing_warns():
    with pytest.warns(UserWarning, match=r"ignore_names \['haed'\] match no parameter"):
        fused_ema.ModelEma(Nested(), 0.9, ignore_names=["haed", "head"])


@pytest.mark.parametrize(
    "filters", [5, {"copy_names": 5, "ignore_names": []}, {"copy_names": [""], "ignore_names": []}]
)
def test_a_corrupted_filters_entry_is_one_clear_error(filters):
    model = Nested()
    ema = fused_ema.ModelEma(model, 0.9)
    state = ema.state_dict()
    state["filters"] = filters
    with pytest.raises(fused_ema.CheckpointError, match="filters: "):
        ema.load_state_dict(state)


@pytest.mark.parametrize(
    ("model_dtype", "kwargs", "to"),
    [
        (torch.bfloat16, {"ignore_names": ["0.bias"]}, None),
        (torch.bfloat16, {"buffers": "ignore"}, None),
        (torch.float32, {"ignore_names": ["0.bias"], "dtype": torch.float64}, None),
        (torch.float32, {"buffers": "ignore"}, torch.float64),
        (torch.float32, {"ignore_names": ["2.weight"]}, torch.float64),
    ],
)
def test_the_module_runs_with_what_the_ema_leaves_out_in_its_dtype(model_dtype, kwargs, to):
    # The left-out copies kept the model's dtype: ema.module mixed a bf16 bias (or BatchNorm
    # statistics) with float32 EMA weights, or float32 ones with a float64 EMA, and raised.
    torch.manual_seed(31)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Linear(12, 3))
    model.train()
    model(torch.randn(16, 6))  # running statistics of its own
    model.to(model_dtype)
    ema = fused_ema.ModelEma(model, decay=0.5, **kwargs)
    reference = copy.deepcopy(model).double().eval()  # what is left out: copies taken then
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update(model)
    ema.update(model)
    if to is not None:
        ema.to(to)
    dtype = ema.module[0].weight.dtype
    x = torch.randn(5, 6)
    out = ema.module(x.to(dtype))
    assert out.dtype == dtype
    reference.load_state_dict(ema.state_dict()["weights"], strict=False)
    expected = reference(x.double())
    assert torch.allclose(out.double(), expected, rtol=1e-3, atol=1e-3)
