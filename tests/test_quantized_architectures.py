"""Lossy chain blocks (kv_codec "q8" and "q4") on every architecture of
test_mlx_architectures: the restored rows are within the codec's error of
the saved ones, and the canary, with the codec's tolerance, passes the
state in the model that made it and fails it in a model of the same
architecture with other weights.  A restore through load_prompt_cache's
default (checked) path is then a hit."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.models import cache as mlc  # noqa: E402

from kvstore import mlx as kvmlx  # noqa: E402
from kvstore.mlx import canary  # noqa: E402
from test_mlx_architectures import ARCHITECTURES, build, model_store, prefill, token_ids  # noqa: E402

# Relative L2 error of a restored float tensor (random float32 weights).
ERROR = {"q8": 0.02, "q4": 0.2}


def float_rows(cache):
    """{name: float32 NumPy copy} of the cache's floating positional tensors."""
    tensors, _, positional = kvmlx.codecs.cache_state(cache)
    return {k: np.array(tensors[k].astype(mx.float32)) for k in positional
            if mx.issubdtype(tensors[k].dtype, mx.floating)}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_lossy_restore_is_close_and_passes_the_canary_of_its_own_model_only(arch, tmp_path):
    model, _ = build(arch)
    other, _ = build(arch, seed=1)
    ids = token_ids(arch)
    cache = mlc.make_prompt_cache(model)
    prefill(model, cache, ids)
    want = float_rows(cache)
    text = b"arch " + arch.encode() + b" " + bytes(ids)
    for codec in ("q8", "q4"):
        with model_store(tmp_path / codec, model, kv_codec=codec) as store:
            assert kvmlx.save_prompt_cache(store, text, ids, cache, model) is not None
            if not want:
                continue                        # no rows: nothing lossy, nothing to compare
            assert store.load(store.find(text)).lossy == codec
            restored = kvmlx.load_prompt_cache(store, text, model, check=False)[0]
            got = float_rows(restored)
            for name, w in want.items():
                d = np.linalg.norm(got[name] - w) / max(np.linalg.norm(w), 1e-30)
                assert d <= ERROR[codec], f"{codec} {name}: relative error {d:.3g}"
            own = canary.check(model, restored, ids, codec)
            theirs = canary.check(other, kvmlx.load_prompt_cache(store, text, model, check=False)[0], ids, codec)
            assert own.ok, (codec, own)
            assert not theirs.ok, (codec, theirs)
            assert kvmlx.load_prompt_cache(store, text, model) is not None      # the checked load: a hit
