"""The four failures of the design brief, rebuilt. Each runs on the CPU (a dtype or file-location
stand-in where the original needs two devices) and, where CUDA exists, as the real two-device case.

1. timm ModelEmaV3(device="cpu") of a CUDA model: the device was decided once and stored.
2. Recognize-Anything: tensors left on another device than the rest of the model.
3. VAR: a checkpoint restored onto the device it was saved from, not the EMA's.
4. LLMs-from-scratch: a head replaced after model.to(device), left on the CPU.
"""

import pytest
import torch
from torch import nn

import fused_ema
from ema_helpers import small_mlp, train_step

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference_run(model, steps, decay, update):
    """Trains `model`, calling update(model) after each step, and returns a float64 EMA of the
    parameters computed independently (first update copies, then lerp with 1 - decay)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    reference = {}
    for step in range(1, steps + 1):
        train_step(model, opt, g, device=device)
        update(model)
        for name, p in model.named_parameters():
            value = p.detach().to("cpu", torch.float64)
            if step == 1:
                reference[name] = value.clone()
            else:
                reference[name] += (1 - decay) * (value - reference[name])
    return reference


def drift_and_track(model, ema, decay, steps=20):
    """Moves every parameter randomly in place (whatever its device and dtype), updating `ema`
    after each move; returns the float64 EMA of the parameters computed independently."""
    reference = {}
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        ema.update(model)
        for name, p in model.named_parameters():
            value = p.detach().to("cpu", torch.float64)
            previous = reference.get(name)
            reference[name] = (
                value.clone() if step == 1 else previous + (1 - decay) * (value - previous)
            )
    return reference


def assert_tracks(ema, reference, rtol=1e-5):
    weights = ema.state_dict()["weights"]
    for name, ref in reference.items():
        got = weights[name].to("cpu", torch.float64)
        assert float((got - ref).abs().max()) <= rtol * float(ref.abs().max()) + 1e-7, name


# 1 ----------------------------------------------------------------------------------------


def test_1_model_changes_dtype_after_the_ema_was_built():
    torch.manual_seed(1)
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9, device="cpu")
    model.to(torch.bfloat16)  # decided at every update, not once at construction
    reference = reference_run(model, 30, 0.9, ema.update)
    assert ema.state_dict()["weights"]["0.weight"].dtype == torch.float32
    assert_tracks(ema, reference)
    model.to(torch.float64)  # a pair the kernel lacks: staged through a conversion
    ema.update(model)


@cuda
def test_1_cpu_ema_of_a_cuda_model():
    torch.manual_seed(1)
    model = small_mlp(device="cuda")
    ema = fused_ema.ModelEma(model, decay=0.9, device="cpu")
    reference = reference_run(model, 30, 0.9, ema.update)
    assert all(t.device.type == "cpu" for t in ema.state_dict()["weights"].values())
    assert_tracks(ema, reference)
    groups = ema._binding.plan.groups.values()
    assert any(v.numel() for g in groups for v in g.staging)  # through the pinned staging buffers


@cuda
def test_1_model_moved_to_cuda_after_the_ema_was_built():
    torch.manual_seed(1)
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9)  # device=None: the EMA follows the model
    ema.update(model)
    model.to("cuda")
    reference = reference_run(model, 20, 0.9, ema.update)
    assert all(t.device.type == "cuda" for t in ema.state_dict()["weights"].values())
    assert_tracks(ema, reference)


# 2 ----------------------------------------------------------------------------------------


def test_2_tensors_on_mixed_dtypes_are_grouped():
    torch.manual_seed(2)
    model = nn.ModuleDict(
        {
            "a": nn.Linear(4, 4),
            "b": nn.Linear(4, 4).to(torch.bfloat16),
            "c": nn.Linear(4, 4).to(torch.float64),
            "d": nn.Linear(4, 4).to(torch.float16),
        }
    )
    ema = fused_ema.ModelEma(model, decay=0.8)
    reference = drift_and_track(model, ema, decay=0.8)
    weights = ema.state_dict()["weights"]
    assert weights["c.weight"].dtype == torch.float64 and weights["b.weight"].dtype == torch.float32
    assert_tracks(ema, reference)


def test_2_raw_op_refuses_a_pair_on_two_devices_naming_both():
    with pytest.raises(RuntimeError, match=r"src\[1\] is on meta but ema\[1\] is on cpu"):
        fused_ema.lerp_(
            [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.ones(3, device="meta")], 0.5
        )


@cuda
@pytest.mark.parametrize("ema_device", [None, "cuda", "cpu"])
def test_2_model_split_across_cpu_and_cuda(ema_device):
    torch.manual_seed(2)
    model = nn.ModuleDict({"body": nn.Linear(8, 8).cuda(), "side": nn.Linear(8, 8)})
    ema = fused_ema.ModelEma(model, decay=0.8, device=ema_device)
    reference = drift_and_track(model, ema, decay=0.8)
    weights = ema.state_dict()["weights"]
    expected = {
        None: {"body": "cuda", "side": "cpu"},
        "cuda": {"body": "cuda", "side": "cuda"},
        "cpu": {"body": "cpu", "side": "cpu"},
    }[ema_device]
    for name, kind in expected.items():
        assert weights[f"{name}.weight"].device.type == kind
    assert_tracks(ema, reference)


# 3 ----------------------------------------------------------------------------------------


class _SavedFromCuda:
    """Makes torch.save record storages as living on cuda:0, as a file written on a GPU machine
    does, so the CPU-only suite can read such a file."""

    active = False

    @classmethod
    def tag(cls, obj):
        return "cuda:0" if cls.active else None

    @staticmethod
    def restore(obj, location):
        return None


torch.serialization.register_package(0, _SavedFromCuda.tag, _SavedFromCuda.restore)


def test_3_checkpoint_saved_on_cuda_loads_into_a_cpu_ema(tmp_path):
    torch.manual_seed(3)
    model = small_mlp()
    source = fused_ema.ModelEma(model, decay=0.9)
    reference_run(model, 5, 0.9, source.update)
    path = tmp_path / "ema_from_gpu.pt"
    _SavedFromCuda.active = True
    try:
        torch.save(source.state_dict(), path)
    finally:
        _SavedFromCuda.active = False
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)  # the file really names a CUDA device
    target = fused_ema.ModelEma(small_mlp(), decay=0.9)
    result = target.load_state_dict(path)
    assert result.format == "fused_ema" and not result.missing_keys
    assert target.step == 5
    for name, value in source.state_dict()["weights"].items():
        loaded = target.state_dict()["weights"][name]
        assert loaded.device.type == "cpu" and torch.equal(loaded, value), name


def test_3_checkpoint_maps_to_the_ema_dtype():
    torch.manual_seed(3)
    model = small_mlp(torch.bfloat16)
    with pytest.warns(fused_ema.PrecisionWarning):
        low = fused_ema.ModelEma(
            model, decay=0.999, dtype=torch.bfloat16, stochastic_rounding=False
        )
    low.update(model)
    full = fused_ema.ModelEma(model, decay=0.999)
    full.load_state_dict(low.state_dict())
    weights = full.state_dict()["weights"]
    assert weights["0.weight"].dtype == torch.float32
    assert torch.equal(weights["0.weight"], low.state_dict()["weights"]["0.weight"].float())


@cuda
@pytest.mark.parametrize("direction", [("cuda", "cpu"), ("cpu", "cuda")])
def test_3_checkpoint_across_devices(tmp_path, direction):
    saved_on, loaded_on = direction
    torch.manual_seed(3)
    model = small_mlp(device=saved_on)
    source = fused_ema.ModelEma(model, decay=0.9)
    reference_run(model, 5, 0.9, source.update)
    torch.save(source.state_dict(), tmp_path / "ema.pt")
    target_model = small_mlp(device=loaded_on)
    target = fused_ema.ModelEma(target_model, decay=0.9)
    target.load_state_dict(str(tmp_path / "ema.pt"))
    target.load_state_dict(torch.load(tmp_path / "ema.pt", weights_only=True))
    for name, value in source.state_dict()["weights"].items():
        loaded = target.state_dict()["weights"][name]
        assert loaded.device.type == loaded_on
        assert torch.equal(loaded.cpu(), value.cpu()), name
    target.update(target_model)  # and it keeps working there


# 4 ----------------------------------------------------------------------------------------


class TinyGPT(nn.Module):
    def __init__(self, vocab=20, width=8):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.block = nn.Linear(width, width)
        self.out_head = nn.Linear(width, vocab, bias=False)


def test_4_head_replaced_after_the_ema_was_built():
    model = TinyGPT()
    ema = fused_ema.ModelEma(model, decay=0.9)
    ema.update(model)
    model.out_head = nn.Linear(8, 2)  # the classification head of the fine-tuning chapter
    with pytest.raises(fused_ema.StructureMismatchError, match="out_head.weight") as info:
        ema.update(model)
    assert "out_head.bias" in info.value.added
    ema.resync(model)
    ema.update(model)
    assert ema.module.out_head.weight.shape == (2, 8)


@cuda
def test_4_head_replaced_after_model_to_cuda_stays_on_cpu():
    model = TinyGPT().to("cuda")
    ema = fused_ema.ModelEma(model, decay=0.9, on_mismatch="resync")
    ema.update(model)
    model.out_head = nn.Linear(8, 2)  # left on the CPU, half the model on CUDA
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        ema.update(model)
    weights = ema.state_dict()["weights"]
    assert weights["out_head.weight"].device.type == "cpu"
    assert weights["block.weight"].device.type == "cuda"
