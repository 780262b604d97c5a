"""What an EMA update costs the training loop beyond its memory traffic: no host syncs (the step
and decay live in tensors), one torch.compile graph with no recompiles, CUDA-graph capture, and a
non_blocking update whose copies are ordered by streams and whose CPU work runs on a worker."""

import threading
import time

import pytest
import torch

import fused_ema
import fused_ema._update.plan as plan_module
from ema_helpers import small_mlp, train_step

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


class CountHostReads:
    """Counts every Python-level read of a tensor value (.item(), float(t), bool(t), .tolist(),
    .numpy(), ...): each is a host sync when the tensor lives on a GPU."""

    def __enter__(self):
        self.count, self.saved = 0, {}
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self.saved[name] = original

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


@pytest.mark.parametrize(
    "config, step_kind",
    [
        (dict(decay=0.999), None),
        (dict(decay=0.99, warmup=True, update_after_step=3, update_every=2), None),
        (dict(decay=0.99, warmup=(5.0, 0.5)), "int"),
        (dict(decay=0.99, warmup=True), "tensor"),
        (dict(decay=0.99, dtype=torch.bfloat16), None),  # stochastic rounding
    ],
)
def test_update_reads_nothing_back_to_the_host(config, step_kind):
    model = small_mlp()
    ema = fused_ema.ModelEma(model, **config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = torch.zeros((), dtype=torch.int64)
    for step in range(1, 21):
        train_step(model, opt)
        counter += 1
        value = {None: None, "int": step, "tensor": counter}[step_kind]
        with CountHostReads() as reads:
            ema.update(model, step=value)
        assert reads.count == 0, f"step {step}: {reads.count} host reads in update()"
    assert ema.step == 20


def test_host_read_counter_sees_reads():
    with CountHostReads() as reads:
        float(torch.ones(()))
        torch.ones(2).tolist()
    assert reads.count == 2


@cuda
@pytest.mark.parametrize("step_kind", [None, "tensor"])
def test_cuda_update_has_no_sync(step_kind):
    model = small_mlp(device="cuda")
    ema = fused_ema.ModelEma(model, decay=0.99, warmup=True, update_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_t = torch.zeros((), dtype=torch.int64, device="cuda")
    ema.update(model)  # plans on the first call
    torch.cuda.synchronize()
    for _ in range(10):
        train_step(model, opt, device="cuda")
        step_t += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            ema.update(model, step=step_t if step_kind else None)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_compiled_training_step_one_graph_no_recompiles():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = small_mlp()
    eager_model = small_mlp()
    eager_model.load_state_dict(model.state_dict())
    settings = dict(decay=0.995, warmup=True, update_after_step=2)
    ema = fused_ema.ModelEma(model, **settings)
    eager_ema = fused_ema.ModelEma(eager_model, **settings)

    def apply_step(net, averager, step, lr=0.05):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(p.grad, alpha=-lr)
                p.grad = None
        averager.update(net, step)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(apply_step, backend=counter, fullgraph=True)
    step = torch.zeros((), dtype=torch.int64)
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        x = torch.randn(16, 6, generator=g)
        step += 1
        for net in (model, eager_model):
            net(x).square().mean().backward()
        compiled(model, ema, step)
        apply_step(eager_model, eager_ema, step)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for 100 steps"
    assert ema.step == eager_ema.step == 100
    ours, theirs = ema.state_dict()["weights"], eager_ema.state_dict()["weights"]
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7)


@cuda
def test_cuda_graph_capture_replays_with_a_changing_decay():
    torch.manual_seed(2)
    model = small_mlp(device="cuda")
    reference_model = small_mlp(device="cuda")
    reference_model.load_state_dict(model.state_dict())
    settings = dict(decay=0.99, warmup=True)
    ema = fused_ema.ModelEma(model, **settings)
    reference = fused_ema.ModelEma(reference_model, **settings)
    params = list(model.parameters())
    noise = [torch.randn_like(p) for p in params]

    def step():
        with torch.no_grad():
            torch._foreach_add_(params, noise, alpha=0.01)
        ema.update(model)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside the graph, as capture requires
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ref_params = list(reference_model.parameters())
    # Capturing records the step without running it: the reference replays the 3 warm-up steps.
    for _ in range(3):
        with torch.no_grad():
            torch._foreach_add_(ref_params, noise, alpha=0.01)
        reference.update(reference_model)
    decays = []
    for _ in range(30):
        graph.replay()
        with torch.no_grad():
            torch._foreach_add_(ref_params, noise, alpha=0.01)
        reference.update(reference_model)
        decays.append(ema.current_decay)
    assert len(set(decays)) == 30, "the decay did not change between replays"
    assert ema.step == reference.step == 33
    for name, value in reference.state_dict()["weights"].items():
        torch.testing.assert_close(ema.state_dict()["weights"][name], value, rtol=0, atol=0)


# ------------------------------------------------------------------------- non_blocking


@pytest.fixture
def slow_worker(monkeypatch):
    """Makes the worker's CPU update take a while, so ordering bugs cannot hide behind speed."""
    real = plan_module.lerp_
    main = threading.main_thread()

    def slow(*args, **kwargs):
        if threading.current_thread() is not main:
            time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_module, "lerp_", slow)


def run_pair(steps, non_blocking_model, device="cpu"):
    """Trains two identical models, one EMA updated non_blocking and one blocking."""
    torch.manual_seed(3)
    blocking_model = small_mlp(device=device)
    non_blocking_model.load_state_dict(blocking_model.state_dict())
    a = fused_ema.ModelEma(non_blocking_model, decay=0.9, device="cpu", warmup=True)
    b = fused_ema.ModelEma(blocking_model, decay=0.9, device="cpu", warmup=True)
    opt_a = torch.optim.SGD(non_blocking_model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(blocking_model.parameters(), lr=0.1)
    for step in range(steps):
        g1, g2 = (torch.Generator().manual_seed(step) for _ in range(2))
        train_step(non_blocking_model, opt_a, g1, device=device)
        train_step(blocking_model, opt_b, g2, device=device)
        a.update(non_blocking_model, non_blocking=True)
        b.update(blocking_model)
    return a, b


def assert_same(a, b):
    wa, wb = a.state_dict()["weights"], b.state_dict()["weights"]
    for name in wb:
        assert torch.equal(wa[name], wb[name]), name


def averaged_then_moved():
    """A CPU EMA that has copied a model, which then moved every parameter by +1."""
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.5, device="cpu")
    ema.update(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model, ema


def test_non_blocking_equals_blocking():
    a, b = run_pair(15, small_mlp())
    assert a.step == b.step == 15
    assert_same(a, b)


def test_non_blocking_returns_before_the_work_and_reads_wait(slow_worker):
    model, ema = averaged_then_moved()
    start = time.perf_counter()
    ema.update(model, non_blocking=True)
    assert time.perf_counter() - start < 0.15, "update(non_blocking=True) waited for the work"
    weights = ema.state_dict()["weights"]  # waits for the worker
    assert torch.equal(weights["0.bias"], model[0].bias.detach() - 0.5)


def test_model_changed_right_after_update_does_not_leak_in(slow_worker):
    # The CPU stand-in of the stream ordering: the update must use the weights as they were
    # when update() was called, however long the worker takes and whatever runs meanwhile.
    model, ema = averaged_then_moved()
    expected = {
        n: v + 0.5
        for n, v in ema.state_dict()["weights"].items()
        if v.is_floating_point() and n in dict(model.named_parameters())
    }
    ema.update(model, non_blocking=True)
    with torch.no_grad():  # "the next optimizer step"
        for p in model.parameters():
            p.mul_(-3.0)
    ema.synchronize()
    weights = ema.state_dict()["weights"]
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-6, atol=1e-6)


def test_worker_errors_surface_at_the_next_call(monkeypatch):
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.5, device="cpu")
    main = threading.main_thread()
    real = plan_module.lerp_

    def failing(*args, **kwargs):
        if threading.current_thread() is not main:
            raise RuntimeError("disk on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_module, "lerp_", failing)
    ema.update(model)
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model, non_blocking=True)
    with pytest.raises(RuntimeError, match="disk on fire"):
        ema.update(model)
    # the failed update wrote nothing and its step is undone
    assert ema.step == 1
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, before[name]), name
    monkeypatch.setattr(plan_module, "lerp_", real)
    ema.update(model, non_blocking=True)
    ema.synchronize()  # and the EMA works again afterwards


def test_module_fetched_earlier_waits_for_a_non_blocking_update(slow_worker):
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.5, device="cpu")
    module = ema.module
    ema.update(model)
    with torch.no_grad():
        model[3].bias.add_(2.0)
    ema.update(model, non_blocking=True)
    module(torch.randn(4, 6))  # its forward waits first
    assert torch.equal(module[3].bias, model[3].bias.detach() - 1.0)


def test_non_blocking_update_after_ema_module_requires_grad(slow_worker):
    """ema.module.requires_grad_(True) makes the EMA tensors require grad; the update is no
    autograd op, and grad mode is per thread: the worker switches it off for its own job."""
    torch.manual_seed(12)
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.75, device="cpu")
    ema.module.requires_grad_(True)
    reference = {n: v.double() for n, v in ema.state_dict()["weights"].items()}
    g = torch.Generator().manual_seed(13)
    for non_blocking in (True, False, True, True):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        weight = 1.0 if ema.step == 0 else 0.25
        ema.update(model, non_blocking=non_blocking)
        for name, value in model.state_dict().items():
            if value.is_floating_point():
                reference[name] += weight * (value.double() - reference[name])
            else:
                reference[name] = value.double()
        assert torch.is_grad_enabled()
    for name, value in ema.state_dict()["weights"].items():
        torch.testing.assert_close(value.double(), reference[name], rtol=1e-6, atol=1e-6)
    assert all(p.requires_grad for p in ema.module.parameters())  # left as the user set it


@cuda
def test_cuda_model_cpu_ema_non_blocking_is_stream_ordered():
    a, b = run_pair(10, small_mlp(device="cuda"), device="cuda")
    assert_same(a, b)
    model = small_mlp(device="cuda")
    ema = fused_ema.ModelEma(model, decay=0.5, device="cpu")
    ema.update(model)
    big = torch.randn(4096, 4096, device="cuda")
    expected = {n: (p.detach().cpu() + 1.0) for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model, non_blocking=True)
    with torch.no_grad():  # queued right behind the copies on the training stream
        for _ in range(5):
            big = big @ big / 4096
        for p in model.parameters():
            p.mul_(-3.0)
    ema.synchronize()
    weights = ema.state_dict()["weights"]
    for name, value in expected.items():
        previous = value - 1.0
        torch.testing.assert_close(weights[name], previous + 0.5 * (value - previous))


def _compiled_update():
    def apply_step(net, averager, step):
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(0.5)
        averager.update(net, step)

    return torch.compile(apply_step, fullgraph=True)


def test_compiled_update_refuses_a_replaced_parameter_as_eager_does():
    torch._dynamo.reset()
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9)
    compiled = _compiled_update()
    step = torch.zeros((), dtype=torch.int64)
    for _ in range(3):
        step += 1
        compiled(model, ema, step)
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    model[0].weight = torch.nn.Parameter(torch.randn(16, 6))  # same name and shape, new tensor
    step += 1
    with pytest.raises(fused_ema.StructureMismatchError, match="0.weight"):
        compiled(model, ema, step)
    assert ema.step == 3
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, before[name]), name
    ema.resync(model)
    compiled(model, ema, step)
    assert ema.step == 4


def test_compiled_update_refuses_a_python_step_as_eager_does():
    # A bool, a float or an int beyond int64 is a ValueError with eager update's message, not a
    # tracing error, and a bool is not taken as 1; nothing changes either way.
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9, warmup=True)
    ema.update(model, 1)
    compiled = torch.compile(lambda s: ema.update(model, s), fullgraph=True, backend="aot_eager")
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    for bad in (True, 2.0, float("nan"), 2**63, "3"):
        with pytest.raises(ValueError) as eager:
            ema.update(model, bad)
        torch._dynamo.reset()
        with pytest.raises(ValueError) as traced:
            compiled(bad)
        assert str(traced.value) == str(eager.value)
        assert ema.step == 1
        for name, value in ema.state_dict()["weights"].items():
            assert torch.equal(value, before[name]), name
    compiled(2)
    assert ema.step == 2


def test_compiled_update_refuses_a_traced_walk_that_disagrees_with_the_c_walk(monkeypatch):
    # The traced walk is the Python form of the C walk; were they ever to differ (here: the same
    # items in another order), the compiled update refuses rather than averaging the wrong values.
    import fused_ema._update.updater as updater_module

    torch._dynamo.reset()
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9)
    compiled = _compiled_update()
    step = torch.ones((), dtype=torch.int64)
    compiled(model, ema, step)
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    real = updater_module.tensor_walk
    monkeypatch.setattr(updater_module, "tensor_walk", lambda m, b: real(m, b)[::-1])
    torch._dynamo.reset()
    compiled = _compiled_update()
    step += 1
    with pytest.raises(RuntimeError, match="walked another model structure"):
        compiled(model, ema, step)
    assert ema.step == 1
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, before[name]), name


def test_compiled_update_on_a_checkpoint_wrapped_model():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch._dynamo.reset()
    torch.manual_seed(8)
    model = small_mlp()
    model[0] = checkpoint_wrapper(model[0])
    eager_model = small_mlp()
    eager_model[0] = checkpoint_wrapper(eager_model[0])
    eager_model.load_state_dict(model.state_dict())
    ema = fused_ema.ModelEma(model, decay=0.9, warmup=True)
    eager = fused_ema.ModelEma(eager_model, decay=0.9, warmup=True)
    assert "0.weight" in ema.names()
    compiled = _compiled_update()
    step = torch.zeros((), dtype=torch.int64)
    for _ in range(4):
        step += 1
        compiled(model, ema, step)
        with torch.no_grad():
            for p in eager_model.parameters():
                p.mul_(0.5)
        eager.update(eager_model, step)
    ours, theirs = ema.state_dict()["weights"], eager.state_dict()["weights"]
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_a_captured_schedule_refuses_to_move(monkeypatch):
    # CPU stand-in for a CUDA graph capture: the schedule marked captured must not move.
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    schedule = ema._schedule
    schedule.captured = True
    before = schedule.step
    with pytest.raises(RuntimeError, match="captured in a CUDA graph"):
        schedule.place(torch.device("meta"))
    assert schedule.step is before and ema.step == 1


@cuda
def test_a_cuda_graph_pins_the_schedule_to_its_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs to move the model across")
    model = small_mlp(device="cuda:0")
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        ema.update(model)
    graph.replay()
    model.to("cuda:1")
    with pytest.raises(RuntimeError, match="captured in a CUDA graph"):
        ema.update(model)
    assert ema.step == 3


def test_a_compiled_update_of_the_models_own_tensors_runs_the_prepared_update():
    # The program hands the op the model's parameters themselves (nothing in the graph wrote
    # them): the update is the eager one, prepared, and ends bit for bit as eager updates do.
    torch._dynamo.reset()
    torch.manual_seed(9)
    model, eager_model = small_mlp(), small_mlp()
    eager_model.load_state_dict(model.state_dict())
    ema = fused_ema.ModelEma(model, decay=0.9, warmup=True)
    eager = fused_ema.ModelEma(eager_model, decay=0.9, warmup=True)
    compiled = torch.compile(lambda net, averager: averager.update(net), fullgraph=True)
    runs = []
    for k in range(4):
        with torch.no_grad():
            for net in (model, eager_model):
                for p in net.parameters():
                    p.mul_(0.5).add_(0.1 * k)
        compiled(model, ema)
        eager.update(eager_model)
        prepared = ema._updater.prepared
        runs.append(None if prepared is None else prepared.runs())
    assert runs[-1] is not None and runs[-1] >= 2, runs
    assert ema.step == eager.step == 4
    ours, theirs = ema.state_dict()["weights"], eager.state_dict()["weights"]
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
