"""Tensor payloads: ABI 16 (a whole prefix) and the blocks of ABI 17, 209 and 145 chains (docs/format.md §3, §14, §20).

A payload is a 24-byte header, a JSON manifest and the blocks it names (the
token ids, then each tensor), written in one pass and read straight into
the destination arrays, every block CRC-checked as it lands.

Rooms:
    manifest  the header and manifest: layout constants, dtypes, validation
    buffers   flat byte views of arrays; positioned reads and writes on a source
    pool      the I/O threads: a block cut into slices read or CRC'd in parallel
    whole     reads of one whole payload: NumPy, and the virtual safetensors
              file mx.load reads
    chains    chain reads: a chain of blocks into one set of tensors
    batch     a chain load's read jobs on the I/O threads, packed blocks' included
    mlx_io    every MLX call: MLX arrays as write sources, loads into MLX
    plan      the write plan of one payload and the pass that writes it
    packing   packed blocks: a tensor block as byte planes, table planes where
              they shrink (ABI 209)
"""

from kvstore.payload.batch import Batch
from kvstore.payload.buffers import bytes_view, pread, pread_into, pwrite_from
from kvstore.payload.chains import ChainBlob, ChainLayout, ChainRead, ChainTensor, Piece, read_chain_numpy
from kvstore.payload.manifest import (BLOCK_ALIGN, DATA_ALIGN, DTYPES, MAGIC, MAX_ARRAY_BYTES, MAX_MANIFEST_BYTES,
                                      MAX_MODEL_CHARS, PAYLOAD_HEADER, VERSION, Manifest, numpy_dtype, read_manifest)
from kvstore.payload.mlx_io import (host_tensors, host_views, is_mlx_array, read_chain_mlx, read_tensors_mlx,
                                    set_mlx_threaded)
from kvstore.payload.plan import Plan, tensor_source
from kvstore.payload.pool import (IO_THREADS, MIN_SLICE, QUEUE_BYTES, gc_paused, io_pool, lower_thread_priority,
                                  read_block, set_io_priority)
from kvstore.payload.whole import VirtualBlob, read_tensors_numpy, read_tokens

__all__ = [
    "MAGIC", "PAYLOAD_HEADER", "VERSION", "DATA_ALIGN", "BLOCK_ALIGN", "MAX_ARRAY_BYTES", "MAX_MANIFEST_BYTES",
    "MAX_MODEL_CHARS", "DTYPES", "Manifest", "read_manifest", "numpy_dtype",
    "bytes_view", "pread", "pread_into", "pwrite_from",
    "MIN_SLICE", "IO_THREADS", "QUEUE_BYTES", "gc_paused", "io_pool", "lower_thread_priority", "set_io_priority",
    "read_block",
    "read_tokens", "read_tensors_numpy", "VirtualBlob",
    "Piece", "ChainTensor", "ChainLayout", "Batch", "ChainBlob", "ChainRead", "read_chain_numpy",
    "host_tensors", "host_views", "set_mlx_threaded", "read_tensors_mlx", "read_chain_mlx",
    "Plan", "is_mlx_array", "tensor_source",
]
