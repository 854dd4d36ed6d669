"""What the MLX tests assume of the backend they run on, in one place.

MLX computes on the CPU here (Linux) and on the GPU through Metal on a Mac,
and Metal picks its kernels by shape and stride: two computations that
differ in chunking, or in a buffer's layout, may round differently there
while they agree on the CPU.  So:

- every exact-logit check compares two runs on the same device with the
  same chunk boundaries (a restored state and a cold prefill, or the live
  cache and its restore), whose inputs are bit-identical: exact on every
  backend, not a tolerance (same_array);
- a bound on rounding is the one measured on the backend the test runs on
  (own_state_bound); where none was measured, the product's own tolerance,
  the promise the test then checks instead.

The report header of a pytest run names the device (tests/conftest.py).
"""

import mlx.core as mx

from kvstore.mlx import canary


def device():
    """"cpu" or "gpu": where MLX computes by default in this process."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


# The canary's distance for a float32 state the model itself made, restored
# bit-exact and recomputed with another chunking: ~1e-6 on MLX's CPU backend
# (docs/semantics.md §17); the bound below leaves 10 times that.  Not measured
# on Metal yet.
OWN_STATE_FLOAT32 = {"cpu": canary.TOLERANCE["float32"] / 100}


def own_state_bound():
    """The largest canary distance a float32 state's own model may give it here."""
    return OWN_STATE_FLOAT32.get(device(), canary.TOLERANCE["float32"])


def same_array(a, b):
    """Two arrays equal bit for bit, with the same dtype and shape (see the module docstring)."""
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


def header():
    """The line a pytest run's header gets."""
    bound = "measured" if device() in OWN_STATE_FLOAT32 else "not measured here: the product's tolerance"
    return (f"MLX device: {device()} (exact-logit checks: same device, same chunking; "
            f"canary rounding bound {own_state_bound():g}, {bound})")
