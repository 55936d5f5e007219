"""The expert activation named by a Hugging Face config's ``hidden_act``, computed as transformers computes it.

One table maps every name transformers' ``ACT2FN`` accepts to a function of one tensor, except those with learned
parameters (``prelu``, ``xielu``: their weights would live inside the activation, which no native model holds),
which ``activation`` refuses by name, as it refuses any name it does not know. Several transformers names are the
same function written differently (the erf GELU in C or in Python; the tanh approximation as a fused kernel or as a
formula): they map to one PyTorch kernel, equal up to rounding.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_clipped_10(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(F.gelu(x), -10.0, 10.0)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _laplace(x: torch.Tensor, mu: float = 0.707107, sigma: float = 0.282095) -> torch.Tensor:
    # the normal CDF at (x - mu) / sigma, with transformers' constants
    return 0.5 * (1.0 + torch.erf((x - mu) / (sigma * math.sqrt(2.0))))


def _sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


ACTIVATIONS: dict[str, Activation] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,                    # exact (erf) GELU
    "gelu_python": F.gelu,             # the erf formula written out: the same function
    "gelu_pytorch_tanh": _gelu_tanh,   # tanh approximation
    "gelu_python_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,            # GPT-2's GELU: the tanh approximation as a formula
    "gelu_accurate": _gelu_tanh,
    "gelu_fast": _gelu_tanh,           # sqrt(2/pi) rounded to 0.7978845608: 3e-12 away
    "gelu_10": _gelu_clipped_10,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "relu2": _relu_squared,
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,        # slope 0.01, nn.LeakyReLU's default
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "laplace": _laplace,
    "sqrtsoftplus": _sqrt_softplus,
    "linear": _identity,
}

# names transformers knows but whose function carries learned weights the native models do not hold
_WITH_PARAMETERS = ("prelu", "xielu")


def check_activation(name: object, *, field: str = "hidden_act") -> str:
    """``name`` if the table has it; else a ValueError that names ``field`` and the value."""
    if not isinstance(name, str) or name not in ACTIVATIONS:
        why = ("it has learned parameters, which the native expert weights cannot hold"
               if name in _WITH_PARAMETERS else "unknown activation")
        raise ValueError(f"{field}={name!r} is not supported ({why}); supported: {', '.join(sorted(ACTIVATIONS))}")
    return name


def activation(name: str) -> Activation:
    return ACTIVATIONS[check_activation(name)]
