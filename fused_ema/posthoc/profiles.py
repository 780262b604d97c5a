"""Power-function EMA profiles (EDM2: Karras et al., "Analyzing and Improving the Training Dynamics
of Diffusion Models", CVPR 2024, sec. 3 and appendix C): gamma <-> sigma_rel, each update's decay,
the closed-form inner products of two profiles (exact for the discrete EMA, time counted in
updates: docs/posthoc.md) and the least squares that combine snapshots into another. All float64."""

from __future__ import annotations

import math

import torch

# sigma_rel(gamma) rises from 0 at gamma = -1 to its maximum at GAMMA_MIN, then falls to 0 as
# gamma grows: every width below the maximum has two exponents. The one kept is gamma >= GAMMA_MIN
# (the cubic's largest real root, as in EDM2); profiles with gamma <= -1/2 are not even square
# integrable, so nothing below GAMMA_MIN takes part in a least-squares fit.
GAMMA_MIN = (math.sqrt(5.0) - 3.0) / 2.0  # about -0.382: d sigma_rel / d gamma = 0
F64 = torch.float64


def _number(label: str, value) -> float:
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{label} must be a real number, got {type(value).__name__}")
    value = float(value)  # also NumPy numbers and one-element tensors
    if not math.isfinite(value):
        raise ValueError(f"{label} must be finite, got {value!r}")
    return value


def gamma_to_sigma_rel(gamma: float) -> float:
    """The relative standard deviation of the power-function profile of exponent gamma (EDM2 eq.
    123): sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3))), for gamma >= GAMMA_MIN = (sqrt(5) -
    3) / 2 (about -0.382), where it is a decreasing bijection onto (0, SIGMA_REL_MAX]."""
    gamma = _number("gamma", gamma)
    if gamma < GAMMA_MIN:
        raise ValueError(
            f"gamma must be >= {GAMMA_MIN!r} ((sqrt(5)-3)/2, where sigma_rel peaks), got "
            f"{gamma!r}: below it sigma_rel falls again and each width would have two exponents"
        )
    return math.sqrt((gamma + 1.0) / (gamma + 3.0)) / (gamma + 2.0)


SIGMA_REL_MAX = gamma_to_sigma_rel(GAMMA_MIN)  # about 0.3003


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent gamma >= GAMMA_MIN whose profile has relative width sigma_rel, for 0 < sigma_rel
    <= SIGMA_REL_MAX (about 0.3003): the largest real root of gamma^3 + 7 gamma^2 + (16 - s^-2)
    gamma + 12 - s^-2 (EDM2 eq. 126, algorithm 2), refined by Newton's method on log
    sigma_rel(gamma) so that gamma_to_sigma_rel(sigma_rel_to_gamma(s)) == s to a few ulps."""
    s = _number("sigma_rel", sigma_rel)
    if not 0.0 < s <= SIGMA_REL_MAX:
        raise ValueError(
            f"sigma_rel must be in (0, {SIGMA_REL_MAX!r}] (the widest power-function profile, at "
            f"gamma = (sqrt(5)-3)/2), got {s!r}"
        )
    if s == SIGMA_REL_MAX:
        return GAMMA_MIN
    if s > 1e-100:
        t = s**-2.0
        companion = torch.tensor(
            [[-7.0, t - 16.0, t - 12.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=F64
        )
        gamma = max(torch.linalg.eigvals(companion).real.max().item(), GAMMA_MIN)
    else:  # s^-2 overflows; sigma_rel ~ 1/gamma for large gamma
        gamma = 1.0 / s
        if not math.isfinite(gamma):
            raise ValueError(f"sigma_rel {s!r} is too small: its gamma overflows a float")
    target = math.log(s)
    for _ in range(100):
        slope = 0.5 * (1.0 / (gamma + 1.0) - 2.0 / (gamma + 2.0) - 1.0 / (gamma + 3.0))
        if slope >= 0.0:  # at GAMMA_MIN (to rounding): the root is there
            break
        log_s = 0.5 * (math.log(gamma + 1.0) - math.log(gamma + 3.0)) - math.log(gamma + 2.0)
        step = (log_s - target) / slope
        gamma, before = max(gamma - step, GAMMA_MIN), gamma
        if gamma == before or abs(step) <= 4 * math.ulp(before):
            break
    return gamma


def power_beta(gamma: float, t: int) -> float:
    """The decay of update t (counted from 1) of a power-function EMA: (1 - 1/t) ** (gamma + 1);
    0 at t = 1, so the first update copies. Any gamma > -1 gives a well-defined average."""
    gamma = _number("gamma", gamma)
    if gamma <= -1.0:
        raise ValueError(f"gamma must be > -1, got {gamma!r}")
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(f"t must be an int >= 1 (updates counted from 1), got {t!r}")
    return (1.0 - 1.0 / t) ** (gamma + 1.0)


def power_profile(t, gamma, tau) -> torch.Tensor:
    """p_{t,gamma}(tau) = (gamma+1)/t * (tau/t) ** gamma for 0 <= tau <= t, else 0: the weight
    per unit of time that a power-function EMA at time t gives to the parameters of time tau."""
    t, gamma, tau = (torch.as_tensor(x, dtype=F64) for x in (t, gamma, tau))
    inside = (tau >= 0) & (tau <= t)
    value = (gamma + 1) / t * (tau.clamp(min=0) / t) ** gamma
    return torch.where(inside, value, torch.zeros((), dtype=F64))


def profile_inner_products(t_a, gamma_a, t_b, gamma_b) -> torch.Tensor:
    """<p_{t_a,gamma_a}, p_{t_b,gamma_b}> = integral of their product (EDM2 eq. 151, algorithm 3),
    broadcast: (gamma_a+1)(gamma_b+1) / ((gamma_a+gamma_b+1) max(t_a, t_b)) * (min/max) ** g,
    where g is the exponent of the longer profile. Needs gamma_a + gamma_b > -1."""
    t_a, gamma_a, t_b, gamma_b = (
        torch.as_tensor(x, dtype=F64) for x in (t_a, gamma_a, t_b, gamma_b)
    )
    longer = torch.where(t_a < t_b, gamma_b, gamma_a)
    shorter_t, longer_t = torch.minimum(t_a, t_b), torch.maximum(t_a, t_b)
    # (gamma_a+1)(gamma_b+1) / (gamma_a+gamma_b+1) rearranged: the product and the sum overflow
    # for the huge gammas of the narrowest widths (sigma_rel ~ 1/gamma), giving nan fit errors
    low, high = torch.minimum(gamma_a, gamma_b), torch.maximum(gamma_a, gamma_b)
    scale = (low + 1) / longer_t / (1 + low / (high + 1))
    return scale * (shorter_t / longer_t) ** longer


def least_squares_coefficients(times, gammas, t: float, gamma: float) -> tuple[torch.Tensor, float]:
    """Coefficients c (float64, one per snapshot of time times[i] and exponent gammas[i]) whose
    combination sum_i c_i p_i is the least-squares fit of p_{t,gamma}, and the fit's relative
    error ||sum_i c_i p_i - p_{t,gamma}|| / ||p_{t,gamma}||.

    As EDM2 (training/phema.py): the normal equations A c = b on the Gram matrix of the snapshots'
    profiles, then c scaled to sum to 1 so the result is a weighted average even where the fit
    falls short. The Gram matrix is solved by minimum-norm least squares (LAPACK gelsd), which also
    covers snapshots whose profiles coincide."""
    times = torch.as_tensor(times, dtype=F64).reshape(-1)
    gammas = torch.as_tensor(gammas, dtype=F64).reshape(-1)
    t, gamma = _number("t", t), _number("gamma", gamma)
    if times.numel() == 0 or times.shape != gammas.shape:
        raise ValueError(
            f"need one or more snapshots, as many times as gammas ({times.numel()} times, "
            f"{gammas.numel()} gammas)"
        )
    if not bool(torch.isfinite(times).all() and (times > 0).all()) or not t > 0:
        raise ValueError("times must be finite and > 0")
    if not bool((gammas >= GAMMA_MIN).all()) or not gamma >= GAMMA_MIN:
        raise ValueError(f"gammas must be >= {GAMMA_MIN!r} ((sqrt(5)-3)/2)")
    gram = profile_inner_products(times[:, None], gammas[:, None], times[None, :], gammas[None, :])
    target = profile_inner_products(times, gammas, t, gamma)
    coefficients = torch.linalg.lstsq(gram, target[:, None], driver="gelsd").solution[:, 0]
    total = coefficients.sum().item()
    if not abs(total) > 1e-12:
        raise ValueError(
            "the snapshots cannot represent this profile (their least-squares coefficients sum "
            "to 0): synthesize at a step where snapshots of the tracked EMAs exist"
        )
    coefficients = coefficients / total
    norm2 = profile_inner_products(t, gamma, t, gamma).item()
    residual2 = (coefficients @ gram @ coefficients - 2 * coefficients @ target).item() + norm2
    return coefficients, math.sqrt(max(residual2, 0.0) / norm2)
