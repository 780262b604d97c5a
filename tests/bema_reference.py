"""BEMA written independently from Block & Zhang's paper, "EMA Without the Lag" (2025), in
float64, with the schedule of TRL's BEMACallback (trl/trainer/callbacks.py): what fused_ema.Bema
and its Trainer callback are checked against."""

import torch


class PaperBema:
    """BEMA in float64, from Block & Zhang's formulas with TRL's schedule (trl BEMACallback): at
    step update_after theta0 and the EMA become the model; every update_freq steps after it,
    EMA <- (1 - beta_t) EMA + beta_t theta_t and theta' = alpha_t (theta_t - theta0) + EMA, with
    beta_t = max((lag + multiplier t)^-ema_power, min_ema_multiplier), alpha_t = (lag +
    multiplier t)^-bias_power and t the training step."""

    def __init__(self, model, update_freq=400, ema_power=0.5, bias_power=0.2, lag=10,
                 update_after=0, multiplier=1.0, min_ema_multiplier=0.0):  # fmt: skip
        self.freq, self.kappa, self.eta, self.rho = update_freq, ema_power, bias_power, lag
        self.tau, self.gamma, self.floor = update_after, multiplier, min_ema_multiplier
        state = self._read(model)
        self.ema, self.theta0, self.out = dict(state), dict(state), dict(state)

    @staticmethod
    def _read(model):
        """A module's state, or a state dict, in float64 on the CPU (integers kept)."""
        state = model.state_dict() if isinstance(model, torch.nn.Module) else model
        return {
            n: v.detach().cpu().clone().double() if v.is_floating_point() else v.detach().clone()
            for n, v in state.items()
        }

    def update(self, model, t):
        theta = self._read(model)
        ints = {n: v for n, v in theta.items() if not v.is_floating_point()}
        if t == self.tau:
            self.ema, self.theta0 = dict(theta), dict(theta)
        elif t > self.tau and (t - self.tau) % self.freq == 0:
            base = self.rho + self.gamma * t
            beta = max(base**-self.kappa, self.floor)
            alpha = base**-self.eta
            self.ema = {n: (1 - beta) * self.ema[n] + beta * theta[n] for n in theta}
            self.out = {n: alpha * (theta[n] - self.theta0[n]) + self.ema[n] for n in theta}
        for part in (self.ema, self.theta0, self.out):
            part.update(ints)  # integer buffers are copied on every update
