"""All or nothing: every public ModelEma call that raises (bad input, a failing worker, an
interrupt, a corrupted checkpoint, a model tensor that cannot be written) leaves the EMA's
tensors, step and schedule, and the model, bit-identical to before, and the EMA usable."""

import copy
import gc
import math
import pickle
import signal
import sys
import threading
import weakref

import pytest
import torch
from interrupts import (
    InterruptAt,
    InterruptAtLine,
    ignore_dropped,
    interrupted_everywhere,
    interrupted_updates,
)
from torch import nn

import fused_ema
from ema_helpers import TiedNet, small_mlp, trained


def state_of(ema):
    """Everything that must not change: weights (bitwise), step, decay and schedule."""
    sd = ema.state_dict()
    return (
        {k: v.clone() for k, v in sd["weights"].items()},
        ema.step,
        ema.current_decay,
        dict(sd["schedule"]),
    )


def assert_same_state(ema, before):
    weights, step, decay, schedule = state_of(ema)
    assert set(weights) == set(before[0])
    for name, value in before[0].items():
        assert torch.equal(weights[name], value), name
    assert (step, schedule) == (before[1], before[3])
    assert decay == before[2] or (math.isnan(decay) and math.isnan(before[2]))


def model_values(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_model_unchanged(model, before):
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def moved_ema(**kwargs):
    """An EMA that has averaged a few steps and differs from its model."""
    torch.manual_seed(0)
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, decay=0.5, **kwargs)
    ema.update(model)
    trained(model, 1, seed=1)
    ema.update(model)
    trained(model, 1, seed=2)
    return model, ema


# ---------------------------------------------------------------------- load_state_dict


def _corrupt(kind):
    def mutate(sd):
        if kind == "step-2**63":
            sd["step"] = 2**63
        elif kind == "step-1e30":
            sd["step"] = 1e30
        elif kind == "step-nan":
            sd["step"] = float("nan")
        elif kind == "step-negative":
            sd["step"] = torch.tensor(-5)
        elif kind == "step-float":
            sd["step"] = 2.5
        elif kind == "update_after_step-2**70":
            sd["schedule"]["update_after_step"] = 2**70
        elif kind == "update_every-0":
            sd["schedule"]["update_every"] = 0
        elif kind == "decay-nan":
            sd["schedule"]["decay"] = float("nan")
        elif kind == "warmup-inf":
            sd["schedule"]["warmup"] = (math.inf, 1.0)
        elif kind == "sparse":
            sd["weights"]["0.weight"] = sd["weights"]["0.weight"].to_sparse()
        elif kind == "meta":
            sd["weights"]["0.bias"] = sd["weights"]["0.bias"].to("meta")
        elif kind == "nested":
            w = sd["weights"]["3.bias"]
            sd["weights"]["3.bias"] = torch.nested.nested_tensor([w, w])
        elif kind == "wrong-shape":
            sd["weights"]["3.weight"] = torch.randn(5, 5)
        elif kind == "integer":
            sd["weights"]["0.weight"] = sd["weights"]["0.weight"].long()
        elif kind == "not-a-tensor":
            sd["weights"]["0.weight"] = [1.0, 2.0]
        elif kind == "missing":
            del sd["weights"]["1.running_var"]
        return sd

    return mutate


CORRUPTIONS = [
    "step-2**63",
    "step-1e30",
    "step-nan",
    "step-negative",
    "step-float",
    "update_after_step-2**70",
    "update_every-0",
    "decay-nan",
    "warmup-inf",
    "sparse",
    "meta",
    "nested",
    "wrong-shape",
    "integer",
    "not-a-tensor",
    "missing",
]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_corrupted_checkpoint_changes_nothing_and_the_ema_keeps_working(kind):
    model, ema = moved_ema(warmup=True)
    source = copy.deepcopy(ema)
    trained(model, 1, seed=7)
    source.update(model)
    sd = source.state_dict()
    sd = {**sd, "weights": dict(sd["weights"]), "schedule": dict(sd["schedule"])}
    sd = _corrupt(kind)(sd)
    before = state_of(ema)
    with pytest.raises(fused_ema.CheckpointError):
        ema.load_state_dict(sd)
    assert_same_state(ema, before)
    ema.update(model)  # still usable
    assert ema.step == before[1] + 1


def test_running_out_of_memory_while_loading_changes_nothing(monkeypatch):
    import fused_ema._state.loading as checkpoint_module

    model, ema = moved_ema(warmup=True)
    sd = copy.deepcopy(ema).state_dict()
    with torch.no_grad():
        for value in sd["weights"].values():
            value.add_(1.0) if value.is_floating_point() else None
    sd["step"] = torch.tensor(40)
    real, calls = checkpoint_module._converted, []

    def out_of_memory(entry, tensor):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("no room")
        return real(entry, tensor)

    monkeypatch.setattr(checkpoint_module, "_converted", out_of_memory)
    before = state_of(ema)
    with pytest.raises(fused_ema.CheckpointError, match="no room"):
        ema.load_state_dict(sd)
    assert_same_state(ema, before)


def test_a_truncated_file_changes_nothing(tmp_path):
    model, ema = moved_ema()
    path = tmp_path / "ema.pt"
    torch.save(ema.state_dict(), path)
    path.write_bytes(path.read_bytes()[:200])
    before = state_of(ema)
    with pytest.raises(fused_ema.CheckpointError, match="could not read it"):
        ema.load_state_dict(path)
    assert_same_state(ema, before)


# ---------------------------------------------------------------------- swapped()


def test_swap_in_failing_part_way_restores_both_sides():
    model, ema = moved_ema()
    with torch.inference_mode():
        frozen = torch.randn(4)
    model[3].bias = nn.Parameter(frozen, requires_grad=False)  # an inference tensor, last
    ema.resync(model)
    before, values = state_of(ema), model_values(model)
    with pytest.raises(RuntimeError, match="inference"):
        with ema.swapped(model):
            pass
    assert_same_state(ema, before)
    assert_model_unchanged(model, values)


# The swap-in's exchange, the swap-out's, and the swap-out's interrupted again and again.
@pytest.mark.parametrize("call", [(1,), (2,), (2, 3, 4)], ids=["in", "out", "out-thrice"])
@pytest.mark.parametrize("after", [False, True])
def test_an_interrupt_next_to_an_exchange_restores_both_sides(monkeypatch, call, after):
    """Each direction of a swap is one call: an interrupt lands before it or after it, and the
    swap-out (repeated after each interrupt) leaves the model and the EMA as they were."""
    import fused_ema._model.swap as swap_module

    model, ema = moved_ema()
    before, values = state_of(ema), model_values(model)
    real, calls, seen = swap_module._swap_values, [], []

    def interrupted(*args):
        calls.append(1)
        if len(calls) in call and not after:
            raise KeyboardInterrupt
        real(*args)
        if len(calls) in call and after:
            raise KeyboardInterrupt

    monkeypatch.setattr(swap_module, "_swap_values", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with ema.swapped(model):
            seen.append(model_values(model))
    monkeypatch.setattr(swap_module, "_swap_values", real)
    assert len(seen) == (call != (1,))
    if seen:  # the block ran with the EMA's weights
        for name, value in before[0].items():
            assert torch.equal(seen[0][name], value), name
    assert_same_state(ema, before)
    assert_model_unchanged(model, values)
    ema.update(model)  # usable: the swap is over


def test_swapping_parameters_that_share_memory_restores_both_sides():
    torch.manual_seed(3)
    model = nn.Module()
    storage = torch.randn(10)
    model.a = nn.Parameter(storage[:6])
    model.b = nn.Parameter(storage[4:])  # overlaps a on elements 4 and 5
    ema = fused_ema.ModelEma(model, decay=0.5)
    with torch.no_grad():
        storage.mul_(3.0)
    ema.update(model)
    before, values = state_of(ema), model_values(model)
    with ema.swapped(model):
        assert torch.equal(model.b.detach(), before[0]["b"])  # the later one wins the overlap
        assert torch.equal(model.a.detach()[:4], before[0]["a"][:4])
    assert_same_state(ema, before)
    assert_model_unchanged(model, values)


def test_module_call_inside_swapped_raises_instead_of_running_training_weights():
    model, ema = moved_ema()
    x = torch.randn(3, 6)
    module = ema.module
    with ema.swapped(model):
        with pytest.raises(RuntimeError, match="inside `with ema.swapped"):
            module(x)
        expected = model.eval()(x)
    torch.testing.assert_close(module(x), expected)


def test_swapped_memory_is_bounded_by_the_scratch_chunk(monkeypatch):
    import fused_ema._model.swap as swap_module

    monkeypatch.setattr(swap_module, "SWAP_CHUNK_BYTES", 4096)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))
    ema = fused_ema.ModelEma(model, decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    seen = []
    real_init = swap_module.Swap.swap_in

    def spy(self):
        real_init(self)
        own = {id(e.ema) for e in ema._binding.table.entries}
        saved = [p for p in self._partners if id(p) not in own]  # EMA values cast, model's saved
        held = (self._scratch, saved)
        seen.append(tuple(sum(s.numel() * s.element_size() for s in ts) for ts in held))

    monkeypatch.setattr(swap_module.Swap, "swap_in", spy)
    before = state_of(ema)
    with ema.swapped(model):
        for name, value in before[0].items():
            assert torch.equal(model.state_dict()[name], value), name
    assert seen == [(4096, 0)]  # one chunk of scratch, nothing saved aside
    assert_same_state(ema, before)


def test_swapped_bf16_model_with_fp32_ema_saves_the_model_aside():
    torch.manual_seed(5)
    model = small_mlp(dtype=torch.bfloat16)
    ema = fused_ema.ModelEma(model, decay=0.5)
    values = model_values(model)
    averages = ema.state_dict()["weights"]
    with ema.swapped(model):
        for name, value in averages.items():
            assert torch.equal(model.state_dict()[name], value.to(torch.bfloat16)), name
    assert_model_unchanged(model, values)


# ---------------------------------------------------------------------- updates


def test_integer_buffer_resized_in_place_changes_nothing():
    model, ema = moved_ema()
    before = state_of(ema)
    model[1].num_batches_tracked.resize_(2)
    with pytest.raises(fused_ema.StructureMismatchError, match="nothing was changed") as info:
        ema.update(model)
    assert "1.num_batches_tracked" in str(info.value)
    assert_same_state(ema, before)


@pytest.mark.parametrize("non_blocking", [False, True])
@pytest.mark.parametrize("name", ["0.weight", "1.running_mean", "1.num_batches_tracked"])
def test_a_model_tensor_whose_memory_was_freed_is_refused_and_changes_nothing(name, non_blocking):
    """resize_(0), as FSDP frees a parameter: a clear error instead of reading freed memory (a
    non_blocking update's staging copy crashed the process); once the memory is back the next
    update averages it."""
    model, ema = moved_ema()
    before = state_of(ema)
    tensor = model.get_parameter(name) if "weight" in name else model.get_buffer(name)
    values = tensor.detach().clone()
    tensor.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=rf"the model's {name} has no memory for its elements"):
        ema.update(model, non_blocking=non_blocking)
        ema.synchronize()
    assert_same_state(ema, before)
    tensor.untyped_storage().resize_(values.nbytes)
    with torch.no_grad():
        tensor.copy_(values)
    weights = before[0]
    ema.update(model)
    got = ema.state_dict()["weights"]
    if values.is_floating_point():  # averaged at the decay the failed update left: 0.5
        expected = weights[name].double().lerp(values.double(), 0.5).float()
        torch.testing.assert_close(got[name], expected, rtol=0, atol=1e-6)
    else:
        assert torch.equal(got[name], values)


@pytest.mark.parametrize("call", ["set", "copy_to", "swapped", "stats", "resync", "update_added"])
@pytest.mark.parametrize("shrunk", [False, True])
def test_every_call_that_reads_a_model_tensor_refuses_a_freed_one(call, shrunk):
    """Not only update(): the calls that copy or read model tensors in Python (torch's ops would
    read the freed memory: a crash, or garbage from a shrunk storage) name the tensor, change
    nothing, and work again once the memory is back."""
    model, ema = moved_ema(on_mismatch="resync")
    if call in ("resync", "update_added"):
        model.append(nn.Linear(4, 3))
        tensor, name = model[-1].weight, f"{len(model) - 1}.weight"
    else:
        tensor, name = model[0].weight, "0.weight"
    before, model_before = state_of(ema), copy.deepcopy(model.state_dict())
    values = tensor.detach().clone()
    tensor.untyped_storage().resize_(values.nbytes // 2 if shrunk else 0)

    def swap():
        with ema.swapped(model):
            pass

    run = {
        "set": lambda: ema.set(model),
        "copy_to": lambda: ema.copy_to(model),
        "swapped": swap,
        "stats": lambda: ema.stats(model),
        "resync": lambda: ema.resync(model),
        "update_added": lambda: ema.update(model),
    }[call]
    with pytest.raises(ValueError, match=rf"the model's {name} has no memory for its elements"):
        run()
    assert_same_state(ema, before)
    tensor.untyped_storage().resize_(values.nbytes)
    with torch.no_grad():
        tensor.copy_(values)
    for key, value in model.state_dict().items():
        assert torch.equal(value, model_before[key]), key
    run()  # the memory is back


def test_building_an_ema_of_a_model_with_a_freed_tensor_is_refused():
    model = small_mlp()
    model[3].bias.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="the model's 3.bias has no memory for its elements"):
        fused_ema.ModelEma(model)


@pytest.mark.parametrize("name", ["0.weight", "1.running_var"])
def test_a_model_tensor_sharing_the_emas_memory_is_named_and_changes_nothing(name):
    """A model tensor made a view of the EMA's own (`.data =`): the ops refuse the aliasing pair
    by list index; ModelEma names the model's tensor and the EMA's, and changes nothing."""
    model, ema = moved_ema()
    before = state_of(ema)
    kind = "get_parameter" if "weight" in name else "get_buffer"
    get = getattr(model, kind)
    own = get(name).data
    get(name).data = getattr(ema.module, kind)(name).data[:]
    shared = rf"the model's {name} shares memory with the EMA's {name}"
    with pytest.raises(ValueError, match=shared):
        ema.update(model)
    assert_same_state(ema, before)
    get(name).data = own
    ema.update(model)  # averaged again once the model owns its tensor
    expected = before[0][name].double().lerp(own.double(), 0.5).float()
    torch.testing.assert_close(ema.state_dict()["weights"][name], expected, rtol=0, atol=1e-6)


def test_the_emas_own_module_passed_as_the_model_is_named():
    """ema.update(ema.module), and an EMA tensor put into the model as a new Parameter, raised a
    StructureMismatchError ("replaced by a new tensor") whose advice, resync(), then bound the
    EMA to its own tensors; resync() itself did so too."""
    model, ema = moved_ema()
    before = state_of(ema)
    with pytest.raises(ValueError, match=r"the model's 0.weight shares memory with the EMA's 0.w"):
        ema.update(ema.module)
    with pytest.raises(ValueError, match=r"the model's 0.weight shares memory with the EMA's 0.w"):
        ema.resync(ema.module)  # would bind the EMA to its own tensors for good
    model[0].weight = nn.Parameter(ema.module[0].weight.detach())
    with pytest.raises(ValueError, match=r"the model's 0.weight shares memory with the EMA's 0.w"):
        ema.update(model)
    with pytest.raises(ValueError, match=r"the model's 0.weight shares memory with the EMA's 0.w"):
        ema.resync(model)
    assert_same_state(ema, before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_ema_tensors_converted_through_ema_module_are_named_and_change_nothing(dtype):
    """ema.module.double() converts the EMA's tensors under the EMA: the ops refused the dtype pair
    by list index; ema.module.half() and .bfloat16() (a supported pair) went through, and the EMA
    averaged in 16 bits from then on. ModelEma names the tensors and the way out, and changes
    nothing."""
    model, ema = moved_ema()
    ema.module.to(dtype)
    before = state_of(ema)
    hold = rf"converted behind the EMA's back: 0\.weight \({dtype}, averaged in torch.float32\)"
    with pytest.raises(ValueError, match=hold):
        ema.update(model)
    assert_same_state(ema, before)
    ema.to(torch.float32)
    ema.update(model)  # averaged again once converted as a whole
    expected = before[0]["0.weight"].double().lerp(model[0].weight.double(), 0.5).float()
    torch.testing.assert_close(ema.module[0].weight, expected, rtol=0, atol=1e-6)
    model.double()  # the model's dtype moved, not the EMA's: the cast source is not the error
    model[1].running_mean.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="running_mean has no memory") as error:
        ema.update(model)
    assert "EMA tensors hold" not in str(error.value)


@pytest.mark.parametrize("call", ["swapped", "copy_to"])
def test_an_expanded_model_tensor_is_named_before_the_ema_writes_into_it(call):
    """A buffer made by expand() holds one memory location for many elements: writing the EMA's
    values into it is refused by name, before anything changes."""
    model, ema = moved_ema(on_mismatch="resync")
    model.register_buffer("grid", torch.randn(16, 1).expand(16, 3))
    ema.update(model)
    before, model_before = state_of(ema), model_values(model)
    with pytest.raises(ValueError, match="the model's tensors grid repeat one memory location"):
        if call == "copy_to":
            ema.copy_to(model)
        else:
            with ema.swapped(model):
                pytest.fail("swapped into an expanded tensor")
    assert_same_state(ema, before)
    assert_model_unchanged(model, model_before)
    model.grid = model.grid.clone()
    ema.copy_to(model)
    assert torch.equal(model[0].weight, ema.module[0].weight)


@pytest.mark.parametrize("delay_ms", [0.2, 1, 3, 8, 20, 50])
def test_an_interrupt_during_an_update_is_all_or_nothing(delay_ms):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    torch.manual_seed(6)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(24)])
    ema = fused_ema.ModelEma(model, decay=0.75, device="cpu", dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    reference = {k: v.double().clone() for k, v in ema.state_dict()["weights"].items()}
    target = {k: v.double() for k, v in model.state_dict().items()}

    # Only while armed: a signal that comes late (the timer fired as the update returned) is
    # dropped instead of interrupting the test itself, which would end the pytest session.
    armed = [False]

    def interrupt(*_):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    outcomes = set()
    try:
        for _ in range(6):
            step = ema.step
            try:
                armed[0] = True
                signal.setitimer(signal.ITIMER_REAL, delay_ms / 1000)
                ema.update(model)
            except KeyboardInterrupt:
                outcomes.add("interrupted")
            finally:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            assert torch.is_grad_enabled(), "the interrupt left the caller's grad mode off"
            weights = ema.state_dict()["weights"]
            if ema.step == step + 1:
                weight = 1.0 if step == 0 else 0.25
                for k in reference:
                    reference[k] += weight * (target[k] - reference[k])
            else:
                assert ema.step == step
            for k, v in reference.items():
                torch.testing.assert_close(weights[k], v, rtol=1e-12, atol=1e-12)
    finally:
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------- grad mode

without_grad = fused_ema._C.without_grad


def _raises(error):
    assert not torch.is_grad_enabled()
    raise error


def _switches_grad_on():
    torch.set_grad_enabled(True)  # what fn leaves behind does not outlive the call either
    return torch.is_grad_enabled()


def _nested():
    """Inside an outer without_grad: an inner one under enable_grad gives back grad mode on."""
    with torch.enable_grad():
        inner = without_grad(torch.is_grad_enabled)
        after_inner = torch.is_grad_enabled()
    return inner, after_inner, torch.is_grad_enabled()


def _grad_mode_ways_out(grad: bool) -> list:
    """Runs without_grad every way it can end, with grad mode `grad`; returns what failed."""
    failed = []

    def check(what, ok=True):
        if not ok or torch.is_grad_enabled() is not grad:
            failed.append(f"{what} (grad mode now {torch.is_grad_enabled()})")

    torch.set_grad_enabled(grad)
    marker = object()
    check(
        "a normal return",
        without_grad(lambda *a: (torch.is_grad_enabled(), a), marker, 2) == (False, (marker, 2)),
    )
    for error in (ValueError("from fn"), KeyboardInterrupt()):
        try:
            without_grad(_raises, error)
            check(f"{type(error).__name__} swallowed", False)
        except BaseException as raised:
            check(f"{type(error).__name__} raised in fn", raised is error)
    check("fn switching grad mode on", without_grad(_switches_grad_on) is True)
    check("nested", without_grad(_nested) == (False, True, False))
    try:
        without_grad(42)
        check("a non-callable", False)
    except TypeError:
        check("a non-callable")
    return failed


@pytest.mark.parametrize("grad", [True, False], ids=["grad-on", "grad-off"])
def test_without_grad_runs_fn_without_autograd_and_restores_the_mode_every_way_out(grad):
    before = torch.is_grad_enabled()
    try:
        assert _grad_mode_ways_out(grad) == []
    finally:
        torch.set_grad_enabled(before)
    with pytest.raises(TypeError, match="needs fn"):
        without_grad()


def test_without_grad_restores_the_mode_after_an_asynchronous_keyboard_interrupt():
    """A real SIGALRM raising KeyboardInterrupt while fn runs Python code."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    seen = []

    def spin():
        seen.append(torch.is_grad_enabled())
        while True:
            pass

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                signal.setitimer(signal.ITIMER_REAL, 0.01)
                with pytest.raises(KeyboardInterrupt):
                    without_grad(spin)
                assert torch.is_grad_enabled() is grad
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert seen == [False, False]


def test_without_grad_in_a_thread_changes_only_that_threads_mode():
    """Grad mode is per thread: a thread inside without_grad leaves the main thread's alone,
    and gets back its own (on by default in a new thread, or off if it switched it off)."""
    inside, release = threading.Event(), threading.Event()
    results = {}

    def hold():
        inside.set()
        assert release.wait(10)
        return torch.is_grad_enabled()

    def worker():
        results["held"] = without_grad(hold)
        results["after"] = torch.is_grad_enabled()
        results["ways out, grad on"] = _grad_mode_ways_out(True)
        results["ways out, grad off"] = _grad_mode_ways_out(False)
        results["left"] = torch.is_grad_enabled()

    for main_grad in (True, False):
        inside.clear(), release.clear()
        with torch.set_grad_enabled(main_grad):
            thread = threading.Thread(target=worker)
            thread.start()
            assert inside.wait(10)
            assert torch.is_grad_enabled() is main_grad  # the thread is inside without_grad
            release.set()
            thread.join(10)
            assert torch.is_grad_enabled() is main_grad
        assert results == {
            "held": False,
            "after": True,
            "ways out, grad on": [],
            "ways out, grad off": [],
            "left": False,
        }


def _swapped(ema, model):
    with ema.swapped(model):
        pass


def _resynced_update(ema, model):
    model[3].bias = nn.Parameter(model[3].bias.detach().clone())  # a replaced parameter
    ema.update(model)


def _non_blocking_update(ema, model):
    ema.update(model, non_blocking=True)  # the CPU half runs on the worker thread
    ema.synchronize()


def _changed_copy(model):
    other = copy.deepcopy(model)
    trained(other, 1, seed=3)
    return other


# Every public call that switches grad mode off for its own work, and state_dict, which does not.
GRAD_MODE_CALLS = {
    "ModelEma()": lambda ema, model: fused_ema.ModelEma(model, decay=0.9),
    "update": lambda ema, model: ema.update(model),
    "update(non_blocking=True)": _non_blocking_update,
    "update(step=)": lambda ema, model: ema.update(model, step=7),
    "update resyncing": _resynced_update,
    "resync": lambda ema, model: ema.resync(model),
    "set": lambda ema, model: ema.set(model),
    "copy_to": lambda ema, model: ema.copy_to(model),
    "swapped": _swapped,
    "load_state_dict": lambda ema, model: ema.load_state_dict(ema.state_dict()),
    "state_dict": lambda ema, model: ema.state_dict(),
    "full_state_dict": lambda ema, model: ema.full_state_dict(),
    "stats": lambda ema, model: ema.stats(model),
}
# Calls that never switch autograd off in Python: state_dict, and on Python 3.12+ (where the walk
# cache vouches for an unchanged model) a prepared update's steady state, one call into the
# extension that switches it off and back inside.
ONE_CALL = {"update", "update(step=)"} if sys.version_info >= (3, 12) else set()
GRAD_MODE_KEPT_ON = {"state_dict"} | ONE_CALL
# The calls of issue 19 (a SIGALRM in update left autograd off), also with grad mode off, which
# they must leave off (not switch back on).
INTERRUPTED_CALLS = [
    "update",
    "update(non_blocking=True)",
    "swapped",
    "load_state_dict",
    "state_dict",
    "resync",
]
GRAD_MODE_CASES = [(name, True) for name in GRAD_MODE_CALLS] + [
    (name, False) for name in INTERRUPTED_CALLS
]
GRAD_MODE_IDS = [f"{n}-grad-{'on' if g else 'off'}" for n, g in GRAD_MODE_CASES]


def _target_for(name, model):
    return _changed_copy(model) if name in ("copy_to", "swapped") else model


@ignore_dropped
@pytest.mark.parametrize("name, grad", GRAD_MODE_CASES, ids=GRAD_MODE_IDS)
def test_an_interrupt_anywhere_leaves_the_callers_grad_mode(name, grad):
    """Deterministic: each call is interrupted at every point where a signal handler can run
    inside it, in turn; the caller's grad mode must be as it was after every one."""
    call = GRAD_MODE_CALLS[name]
    model, ema = moved_ema(on_mismatch="resync")
    target = _target_for(name, model)

    def grad_mode_kept(interrupted):
        assert torch.is_grad_enabled() is grad, f"grad mode changed ({interrupted=})"
        assert not torch.is_inference_mode_enabled()

    with torch.set_grad_enabled(grad):
        fired = interrupted_everywhere(lambda: call(ema, target), grad_mode_kept)
    ema.synchronize()
    assert len(fired) > 5
    if grad and name not in GRAD_MODE_KEPT_ON:  # some landed where autograd was off
        assert any(hook.grad_when_fired is False for hook in fired)


LINE_CASES = [(name, True) for name in INTERRUPTED_CALLS] + [
    ("update", False),
    ("update(non_blocking=True)", False),
    ("swapped", False),
]


@ignore_dropped
@pytest.mark.parametrize(
    "name, grad", LINE_CASES, ids=[f"{n}-grad-{'on' if g else 'off'}" for n, g in LINE_CASES]
)
def test_an_interrupt_at_any_line_of_fused_ema_leaves_the_callers_grad_mode(name, grad):
    """Stricter than the test above: the call is interrupted at every line of fused_ema's own
    Python code in turn, including where CPython never runs a signal handler, so grad mode must
    be switched and restored with no Python line in between (fused_ema._C.without_grad). Such
    an interrupt can break promises made only for real signals (swapped's restore), so each run
    gets a fresh copy of the EMA and its model, warmed up by one uninterrupted call."""
    call = GRAD_MODE_CALLS[name]
    model, ema = moved_ema(on_mismatch="resync")
    target = _target_for(name, model)
    fresh = []

    def next_pair(interrupted=None):
        if interrupted is not None:
            assert torch.is_grad_enabled() is grad, f"grad mode changed ({interrupted=})"
            assert not torch.is_inference_mode_enabled()
        fresh[:] = copy.deepcopy((ema, target))
        call(*fresh)
        fresh[0].synchronize()

    with torch.set_grad_enabled(grad):
        next_pair()
        fired = interrupted_everywhere(lambda: call(*fresh), next_pair, point=InterruptAtLine)
    assert len(fired) > 20
    if grad and name not in GRAD_MODE_KEPT_ON:
        assert any(hook.grad_when_fired is False for hook in fired)


@pytest.mark.parametrize("grad", [True, False], ids=["grad-on", "grad-off"])
def test_sigalrm_at_tiny_intervals_never_changes_the_callers_grad_mode(grad):
    """Real signals, as in issue 19: a timer raising KeyboardInterrupt after 10 us to 5 ms, over
    and over, during each call (the non_blocking update's worker included)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    torch.manual_seed(8)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(16)])
    ema = fused_ema.ModelEma(model, decay=0.75, on_mismatch="resync")
    armed, outcomes = [False], {name: [] for name in INTERRUPTED_CALLS}

    def interrupt(*_):  # only while armed, as in the SIGALRM test above
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with torch.set_grad_enabled(grad):
            for name in INTERRUPTED_CALLS:
                call = GRAD_MODE_CALLS[name]
                for k in range(36):
                    try:
                        armed[0] = True
                        signal.setitimer(signal.ITIMER_REAL, 1e-5 * 1.2**k)
                        call(ema, model)
                        outcomes[name].append(False)
                    except KeyboardInterrupt:
                        outcomes[name].append(True)
                    finally:
                        armed[0] = False
                        signal.setitimer(signal.ITIMER_REAL, 0)
                    assert torch.is_grad_enabled() is grad, f"{name}: grad mode changed"
                    assert not torch.is_inference_mode_enabled()
                ema.synchronize()
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert all(any(runs) for runs in outcomes.values()), "some call was never interrupted"


@ignore_dropped
def test_an_interrupt_anywhere_in_swapped_restores_both_sides():
    """Deterministic: swapped() interrupted at any point (its swap-in, the block's exit, the
    restore) leaves the EMA and the model as they were, and the EMA usable."""
    model, ema = moved_ema()
    target = _changed_copy(model)
    values, before = model_values(target), [state_of(ema)]

    def restored(interrupted):
        assert_same_state(ema, before[0])
        assert_model_unchanged(target, values)
        ema.update(model)  # still usable
        before[0] = state_of(ema)

    interrupted_everywhere(lambda: _swapped(ema, target), restored)


@ignore_dropped
@pytest.mark.parametrize("point", [InterruptAt, InterruptAtLine], ids=["call", "line"])
@pytest.mark.parametrize("non_blocking", [False, True], ids=["blocking", "non_blocking"])
def test_an_interrupt_anywhere_in_an_update_is_all_or_nothing(non_blocking, point):
    """Deterministic, like the SIGALRM test above: after an update interrupted at any point, the
    EMA is bitwise either as before or as one uninterrupted update makes it, and keeps working.
    non_blocking: also inside the hand-off of its CPU half to the worker thread (a job prepared,
    queued or begun), which the interrupted call finishes or takes back before it returns."""
    model, ema = moved_ema(dtype=torch.float64)
    twin = copy.deepcopy(ema)  # updated, uninterrupted, whenever ema's update went through

    def went_through(interrupted):
        ema.synchronize()
        moved = ema.step != twin.step
        if moved:
            twin.update(model)
        assert_same_state(ema, state_of(twin))
        return moved

    update = lambda: ema.update(model, non_blocking=non_blocking)  # noqa: E731
    interrupted_updates(update, model, went_through, seed=11, point=point)


def test_del_ema_frees_it_at_once_without_a_gc_pass():
    model = small_mlp()
    gc.disable()
    try:
        ema = fused_ema.ModelEma(model, decay=0.5)
        ema.update(model)
        ema.update(model, non_blocking=True)
        ema.synchronize()
        module = ema.module  # the view holds the EMA weakly
        probe = weakref.ref(ema)
        tensor = weakref.ref(ema.state_dict()["weights"]["0.weight"])
        del ema, module
        assert probe() is None, "a reference cycle keeps the EMA alive"
        assert tensor() is None, "the EMA's tensors outlive it"
    finally:
        gc.enable()


def test_deepcopy_after_a_non_blocking_update_and_pickling_round_trip():
    model, ema = moved_ema(device="cpu")
    ema.update(model, non_blocking=True)
    twin = copy.deepcopy(ema)
    restored = pickle.loads(pickle.dumps(ema))
    expected = ema.state_dict()["weights"]
    for other in (twin, restored):
        assert other.step == ema.step
        for name, value in other.state_dict()["weights"].items():
            assert torch.equal(value, expected[name]), name
        assert (
            other.state_dict()["weights"]["0.weight"].data_ptr() != expected["0.weight"].data_ptr()
        )
    x = torch.randn(5, 6)
    torch.testing.assert_close(restored.module(x), ema.module(x))
    # the copies are independent EMAs that keep working
    trained(model, 1, seed=9)
    for other in (ema, twin, restored):
        other.update(model)
    for other in (twin, restored):
        for name, value in other.state_dict()["weights"].items():
            assert torch.equal(value, ema.state_dict()["weights"][name]), name


def test_pickled_module_loads_standalone():
    model, ema = moved_ema()
    module = pickle.loads(pickle.dumps(ema.module))
    x = torch.randn(4, 6)
    torch.testing.assert_close(module(x), ema.module(x))


def test_tied_weights_survive_pickling():
    model = TiedNet()
    ema = fused_ema.ModelEma(model, decay=0.5)
    restored = pickle.loads(pickle.dumps(ema))
    m = restored.module
    assert m.head.weight is m.embed.weight
    restored.update(model)
    assert restored.step == 1


@ignore_dropped
@pytest.mark.parametrize("point", [InterruptAt, InterruptAtLine], ids=["call", "line"])
def test_an_interrupt_anywhere_in_ema_to_is_all_or_nothing(point):
    """ema.to(dtype) interrupted at any point: every tensor, ema.dtype and ema.module as before,
    or all converted as an uninterrupted call converts them (not some, nor the tensors without
    the setting); the EMA keeps working either way."""
    model, ema = moved_ema()
    done = copy.deepcopy(ema).to(torch.float64)
    runs = [copy.deepcopy(ema)]

    def whole(interrupted):
        got = runs[-1]
        dtypes = {v.dtype for v in got.state_dict()["weights"].values() if v.is_floating_point()}
        module = {p.dtype for p in got.module.parameters()}
        assert len(dtypes) == 1 and module == dtypes, (dtypes, module)
        reference = done if dtypes == {torch.float64} else ema
        assert got.dtype == reference.dtype
        assert_same_state(got, state_of(reference))
        got.update(model)
        twin = copy.deepcopy(reference)
        twin.update(model)
        assert_same_state(got, state_of(twin))
        runs.append(copy.deepcopy(ema))

    fired = interrupted_everywhere(lambda: runs[-1].to(torch.float64), whole, point=point)
    assert len(fired) > 20


@ignore_dropped
def test_an_interrupt_anywhere_in_an_update_that_follows_a_new_structure_is_all_or_nothing():
    """on_mismatch="resync": an update that first follows a replaced and an added layer,
    interrupted at any point, leaves the EMA as before (old structure, step) or as one
    uninterrupted update leaves it, never followed but not averaged, and it keeps working."""
    model, ema = moved_ema(on_mismatch="resync")
    model[3] = nn.Linear(16, 5)
    model.append(nn.Linear(5, 2))
    done = copy.deepcopy((ema, model))
    done[0].update(done[1])
    runs = [copy.deepcopy((ema, model))]

    def whole(interrupted):
        got, net = runs[-1]
        reference = done[0] if got.step == done[0].step else ema
        assert_same_state(got, state_of(reference))
        if not interrupted or len(runs) % 4 == 1:  # it keeps working (every 4th point: CI time)
            twin = copy.deepcopy(reference)
            got.update(net)
            twin.update(net)
            assert_same_state(got, state_of(twin))
        runs.append(copy.deepcopy((ema, model)))

    fired = interrupted_everywhere(lambda: runs[-1][0].update(runs[-1][1]), whole)
    assert len(fired) > 20


def _inserted_layer_ema():
    """An EMA of three layers, then a layer inserted at 1: the BatchNorm's tensors are renamed
    from 1.* to 2.*, and the new Linear takes 1.* with the same shapes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    ema = fused_ema.ModelEma(model, decay=0.9, on_mismatch="resync")
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        ema.update(model)
    model.insert(1, nn.Linear(6, 6))
    return model, ema


@ignore_dropped
def test_an_interrupt_while_following_renamed_tensors_keeps_each_average_on_its_tensor():
    """A tensor keeps its average under a new name (matched by identity). An update interrupted
    while following the new structure must leave every entry following its own tensor: it once
    pointed the old entries at the tensors now holding their names, and the next update averaged
    the BatchNorm's bias into the new Linear's. The reference is a fresh, uninterrupted build (a
    deepcopy would match by name, and hide this)."""
    model, ema = _inserted_layer_ema()
    before = state_of(ema)[1]
    ema.update(model)
    expected = state_of(ema)
    runs = [_inserted_layer_ema()]

    def whole(interrupted):
        net, got = runs[-1]
        if got.step == before:  # not begun: the same update again, uninterrupted
            got.update(net)
        assert_same_state(got, expected)
        runs.append(_inserted_layer_ema())

    update = lambda: runs[-1][1].update(runs[-1][0])  # noqa: E731
    fired = interrupted_everywhere(update, whole, point=InterruptAtLine)  # every line of fused_ema
    assert len(fired) > 20


def test_finish_all_runs_every_step_to_its_end_and_raises_the_first_error():
    """swap.finish_all (C, no Python between the steps): an interrupted step runs again (up to 16
    times), a failing one once more, then the next; the first error, with its traceback, last."""
    from fused_ema._model.swap import finish_all

    log, tries = [], {"a": 0}

    def interrupted_twice():
        tries["a"] += 1
        log.append("a")
        if tries["a"] <= 2:
            raise KeyboardInterrupt

    def failing():
        log.append("b")
        raise ValueError("b failed")

    with pytest.raises(KeyboardInterrupt) as info:
        finish_all([interrupted_twice, failing, lambda: log.append("c")])
    assert log == ["a", "a", "a", "b", "b", "c"]
    assert info.value.__traceback__ is not None
    with pytest.raises(ValueError, match="b failed"):
        finish_all((failing,))
    runs = []

    def always_interrupted():  # (an interrupt the step raises itself must not loop forever)
        runs.append(1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finish_all([always_interrupted, lambda: log.append("after")])
    assert len(runs) == 16 and log[-1] == "after"
    finish_all([])
    with pytest.raises(TypeError, match="sequence of callables"):
        finish_all(3)


def test_finish_all_keeps_a_step_that_empties_its_list_alive_while_it_runs_again():
    """A step holds the only reference left to itself once it has cleared the list it came from;
    run again after an interrupt, it must still be there (before: freed, a crash)."""
    from fused_ema._model.swap import finish_all

    runs = []

    class Step:
        def __call__(self):
            runs.append(self.name)
            steps.clear()
            if len(runs) == 1:
                raise KeyboardInterrupt

    steps = [Step(), Step()]
    steps[0].name, steps[1].name = "first", "second"
    with pytest.raises(KeyboardInterrupt):
        finish_all(steps)
    assert runs == ["first", "first"] and steps == []  # the second left the list before its turn
