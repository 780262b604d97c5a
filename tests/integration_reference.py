"""The reference the framework-callback tests compare with: an EMA of the weights recorded after
each optimizer step, by ModelEma's documented rule computed with torch's own lerp (the first step
copies the model, each later step lerps floating tensors by 1 - decay, integer ones are copied)."""

import torch


def snapshot(module: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class ReferenceEma:
    def __init__(self, decay: float):
        self.decay = decay
        self.weights: dict | None = None
        self.steps = 0
        self.history: list[dict] = []  # the training weights after each optimizer step

    def add(self, module: torch.nn.Module) -> None:
        self.add_state(snapshot(module))

    def add_state(self, state: dict) -> None:
        self.history.append(state)
        self.steps += 1
        if self.weights is None:
            self.weights = {k: v.clone() for k, v in state.items()}
            return
        for name, value in state.items():
            if value.is_floating_point():
                self.weights[name].lerp_(value, 1 - self.decay)
            else:
                self.weights[name].copy_(value)


def ema_of(history: list, decay: float) -> dict:
    """The reference EMA after the recorded steps `history`."""
    reference = ReferenceEma(decay)
    for state in history:
        reference.add_state({k: v.clone() for k, v in state.items()})
    return reference.weights


def assert_same(got: dict, want: dict, what: str) -> None:
    """Same names and bit-identical tensors."""
    assert sorted(got) == sorted(want), f"{what}: names {sorted(got)} != {sorted(want)}"
    differ = [k for k in want if not torch.equal(got[k].cpu(), want[k].cpu())]
    assert not differ, f"{what}: {differ} differ, e.g. {differ[0]}: {got[differ[0]]} vs " + str(
        want[differ[0]]
    )
