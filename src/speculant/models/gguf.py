"""Reading a GGUF file's tensors straight into a transformers model: no float32 copy on disk.

transformers loads a llama/qwen2 GGUF through its legacy path (``modeling_gguf_pytorch_utils.load_gguf_checkpoint``):
every tensor is dequantized to float32 with ``gguf.dequantize`` (numpy), passed through the architecture's
``TensorProcessor`` (Llama's reverse Q/K row permutation), renamed with ``get_gguf_hf_weights_map`` and cast to the
requested dtype. :func:`load_gguf_model` does exactly that, one tensor at a time into a model built without
initialising its weights, so the weights are bit-identical to transformers' conversion while peak memory stays near
the model's own size; it reuses transformers' processors and name map, so the reorderings cannot drift.

Decoding runs gguf's own numpy block decoders (the reference itself) over chunks of blocks in threads, straight
into the output (:func:`decode`); vectorised torch decoders for Q4_K/Q6_K/Q5_0/Q8_0, written bit-exact, were
1.5-3x slower than gguf's numpy on this 2-core machine, so there are none. :func:`file_tensors` exposes the raw
block codes (per-group codes, scales and minimums, as tensors) of the types whose blocks have that shape (Q4_K,
Q4_1, Q4_0, Q5_0, Q5_1, Q8_0: :data:`CODE_TYPES`), and Q6_K's codes, ``d`` and sub-scales (:func:`q6_k_codes`), for
quantized linears.

Only architectures whose transform is per tensor are read directly (:data:`DIRECT_ARCHITECTURES`); anything else
takes transformers' full conversion (:func:`speculant.models.sources.convert_gguf`).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

__all__ = ["CODE_TYPES", "DIRECT_ARCHITECTURES", "INT4_TYPES", "Q6_K", "WIDE_TYPES", "decode", "file_tensors",
           "gguf_architecture", "int4_tensors", "load_gguf_model", "q4_0_codes", "q4_1_codes", "q4_k_codes",
           "q5_0_codes", "q5_1_codes", "q6_k_codes", "q8_0_codes"]

log = logging.getLogger(__name__)

DIRECT_ARCHITECTURES = frozenset({"llama", "qwen2"})
"""GGUF ``general.architecture`` values :func:`load_gguf_model` reads (tested equal to transformers' conversion)."""


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte ``start`` of each block, as float32 ``[nb, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(data: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """``[nb, groups * width]`` bytes -> ``[nb, 2 * groups, width]``: per group of ``width`` bytes, low then high
    nibbles (gguf's ``reshape(nb, -1, 1, width) >> [0, 4]``)."""
    x = data.reshape(data.shape[0], groups, 1, width)
    return torch.cat([x & 0xF, x >> 4], dim=2).reshape(data.shape[0], 2 * groups, width)


def q4_k_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw contents of Q4_K super-blocks ``blocks`` (uint8 ``[nb, 144]``): ``(codes, scales, mins)`` with
    ``codes`` uint8 ``[nb, 8, 32]`` (4-bit values, 8 groups of 32 per super-block), ``scales`` and ``mins`` float32
    ``[nb, 8]`` (fp16 ``d``/``dmin`` times the 6-bit group scale/min), so each value is
    ``scales[..., None] * codes.float() - mins[..., None]``, float32, bit-equal to ``gguf.dequantize`` (tested)."""
    nb = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    s = blocks[:, 4:16].reshape(nb, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]  # the 12 bytes of 6-bit scales and mins, ggml's get_scale_min_k4
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    codes = _nibbles(blocks[:, 16:144], 4, 32)
    return codes, d * sc.float(), dmin * mn.float()


def q4_1_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw contents of Q4_1 blocks ``blocks`` (uint8 ``[nb, 20]``): ``(codes, scales, mins)`` with ``codes``
    uint8 ``[nb, 1, 32]`` and ``scales``/``mins`` float32 ``[nb, 1]`` (the fp16 ``d`` and ``m``), each value
    ``scales * codes + mins`` (mins here is ``-m``, as :func:`q4_k_codes`'s: value = scale * code - min)."""
    codes = _nibbles(blocks[:, 4:20], 1, 16).reshape(blocks.shape[0], 1, 32)  # low nibbles: inputs 0-15
    return codes, _half(blocks, 0), -_half(blocks, 2)


def q4_0_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 blocks (uint8 ``[nb, 18]``: fp16 ``d``, 16 bytes of nibbles; value ``d * (q - 8)``) as ``(codes
    [nb, 1, 32], scales [nb, 1], mins [nb, 1])``, value = scale * code - min (``min = 8 d``, exact in float32)."""
    d = _half(blocks, 0)
    return _nibbles(blocks[:, 2:18], 1, 16).reshape(blocks.shape[0], 1, 32), d, 8 * d


def _fifth_bits(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The 32 fifth bits of a Q5_0/Q5_1 block, stored as one little-endian uint32 at byte ``at``: ``[nb, 32]``."""
    qh = blocks[:, at:at + 4].to(torch.int64)
    word = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)  # [nb]
    return ((word[:, None] >> torch.arange(32)) & 1).to(torch.uint8)


def q5_0_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_0 blocks (uint8 ``[nb, 22]``: fp16 ``d``, 4 bytes of fifth bits, 16 bytes of nibbles; value
    ``d * (q - 16)``, q in [0, 32)) as ``(codes [nb, 1, 32], scales [nb, 1], mins [nb, 1])``, ``min = 16 d``."""
    d = _half(blocks, 0)
    low = _nibbles(blocks[:, 6:22], 1, 16).reshape(blocks.shape[0], 32)
    return (low | (_fifth_bits(blocks, 2) << 4)).reshape(-1, 1, 32), d, 16 * d


def q5_1_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_1 blocks (uint8 ``[nb, 24]``: fp16 ``d`` and ``m``, fifth bits, nibbles; value ``d * q + m``) as
    ``(codes [nb, 1, 32], scales [nb, 1], mins [nb, 1])``, ``min = -m``."""
    low = _nibbles(blocks[:, 8:24], 1, 16).reshape(blocks.shape[0], 32)
    return (low | (_fifth_bits(blocks, 4) << 4)).reshape(-1, 1, 32), _half(blocks, 0), -_half(blocks, 2)


def q8_0_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (uint8 ``[nb, 34]``: fp16 ``d``, 32 int8 ``q``; value ``d * q``) as ``(codes [nb, 1, 32]``
    (``q + 128`` in [0, 256)), ``scales [nb, 1], mins [nb, 1])``, ``min = 128 d``."""
    d = _half(blocks, 0)
    q = blocks[:, 2:34].contiguous().view(torch.int8).to(torch.int16) + 128
    return q.to(torch.uint8).reshape(-1, 1, 32), d, 128 * d


def q6_k_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw contents of Q6_K super-blocks ``blocks`` (uint8 ``[nb, 210]``: 128 bytes of low nibbles, 64 of high
    2-bit pairs, 16 int8 scales, fp16 ``d``): ``(codes, d, sc)`` with ``codes`` uint8 ``[nb, 256]`` in ``[0, 64)``,
    ``d`` float32 ``[nb, 1]`` and ``sc`` int8 ``[nb, 16]`` (one per 16 inputs), value ``(d * sc) * (code - 32)`` in
    float32, bit-equal to ``gguf.dequantize`` (tested; the order of gguf's ``dequantize_blocks``)."""
    nb = blocks.shape[0]
    low = blocks[:, :128].reshape(nb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    codes = (low & 0x0F).reshape(nb, 256) | ((high & 0x03).reshape(nb, 256) << 4)
    return codes, _half(blocks, 208), blocks[:, 192:208].contiguous().view(torch.int8)


Q6_K = 14
"""GGML's type number of Q6_K: 6-bit codes, an int8 scale per 16 and a float16 ``d`` per 256, which a ``file`` model keeps
as they are (q6 matrices: :meth:`speculant.core.quant.QuantMatrix.q6`)."""

CODE_TYPES = {12: (q4_k_codes, 144, 4), 3: (q4_1_codes, 20, 4), 2: (q4_0_codes, 18, 4), 6: (q5_0_codes, 22, 8),
              7: (q5_1_codes, 24, 8), 8: (q8_0_codes, 34, 8)}
"""GGML types whose blocks are codes with one scale and one minimum per 32 inputs (Q4_K, Q4_1, Q4_0; Q5_0, Q5_1,
Q8_0): the shape of speculant's int4/q4/q8 matrices (:meth:`speculant.core.quant.QuantMatrix.from_codes`), so their
codes carry over unchanged: ``type: (unpacker, bytes per block, bits of the matrix kind that holds the codes)``."""

INT4_TYPES = frozenset(t for t, (_, _, bits) in CODE_TYPES.items() if bits == 4)
"""The :data:`CODE_TYPES` of 4-bit codes."""

WIDE_TYPES = frozenset({6, 7, 8, 13, 14, 15})
"""GGML block types of 5 to 8 bits per weight (Q5_0, Q5_1, Q8_0, Q5_K, Q6_K, Q8_K): the tensors a quantized file
spends more than 4 bits on, kept at 8 bits (q8) in a q4 model (:func:`speculant.models.loading.quantize_loaded`)."""


def file_tensors(path: str | Path, model: torch.nn.Module, codes: bool = True, six: bool = True):
    """Yield ``(parameter name, ggml type, codes, scale, minimum)`` for each of ``model``'s 2-D parameters in GGUF
    file ``path``. For a :data:`CODE_TYPES` tensor (and ``codes``): codes uint8 ``[out, in]`` (in ``[0, 16)``, or
    ``[0, 256)`` for 5- and 8-bit types), scale and minimum float32 ``[out, in / 32]``, value = ``scale * code +
    minimum``, equal to the file's dequantized value (float32); for a Q6_K tensor (:data:`Q6_K`) codes in ``[0, 64)``,
    ``d`` float32 ``[out, in / 32]`` (each super-block's, repeated per 32) and the int8 sub-scales ``[out, in / 16]``
    in place of scale and minimum (:func:`q6_k_codes`: value ``(d * sc) * (code - 32)``; ``six=False``: None three
    times, for a caller that takes no q6 matrices); rows in the model's order: the architecture's
    ``TensorProcessor`` (Llama's reverse Q/K permutation) is run on the row indices and the codes follow it, so they
    line up with :func:`load_gguf_model`'s weights; for other types ``None`` three times. One tensor at a time (a
    caller quantizes it before the next is unpacked)."""
    header = _Header(path)
    names = _weights_map(model, header.architecture)
    processor = _processor(header.architecture, model.config)
    params = dict(model.named_parameters())
    for name, qtype, data in header.tensors:
        if names.get(name) not in params or data.ndim != 2:
            continue
        rows = data.shape[0]
        result = processor.process(weights=np.arange(rows)[:, None], name=name, tensor_key_mapping=names,
                                   parsed_parameters={"tensors": {}})
        if (qtype not in CODE_TYPES and not (qtype == Q6_K and six)) or not codes:
            yield names[result.name], qtype, None, None, None
            continue
        order = torch.from_numpy(np.ascontiguousarray(result.weights).reshape(rows))  # model row i = file row order[i]
        if qtype == Q6_K:
            c, d, sc = q6_k_codes(torch.from_numpy(np.array(data)).reshape(-1, 210))
            d = d.expand(-1, 8).reshape(rows, -1)  # [out, in / 32]
            yield names[result.name], qtype, c.reshape(rows, -1)[order], d[order], sc.reshape(rows, -1)[order]
            continue
        unpack, size, _ = CODE_TYPES[qtype]
        c, scales, mins = unpack(torch.from_numpy(np.array(data)).reshape(-1, size))  # a copy: the map is read-only
        c, scales, mins = c.reshape(rows, -1), scales.reshape(rows, -1), mins.reshape(rows, -1)
        yield names[result.name], qtype, c[order], scales[order], -mins[order]


def int4_tensors(path: str | Path, model: torch.nn.Module):
    """:func:`file_tensors`' 4-bit code tensors (:data:`INT4_TYPES`) as ``(parameter name, codes, scale,
    minimum)``."""
    for name, qtype, c, scale, minimum in file_tensors(path, model):
        if qtype in INT4_TYPES:
            yield name, c, scale, minimum


def _processor(arch: str, config):
    """transformers' ``TensorProcessor`` of ``arch`` (Llama's undoes llama.cpp's Q/K row permutation)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUF value types
_STRING, _ARRAY = 8, 9


class _Header:
    """A GGUF file's architecture and tensor index, read without materialising its metadata values.

    gguf's ``GGUFReader`` builds a numpy memmap object per metadata item: for a 151,936-token vocabulary and its
    merges that took 10-25 s here, more than dequantizing the whole 0.5B. This walks the same layout
    (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) with ``struct``, keeping only
    ``general.architecture``, ``general.alignment`` and each tensor's name, type, shape and bytes (plain numpy
    views of one memory map)."""

    def __init__(self, path: str | Path):
        import mmap
        import struct

        with open(path, "rb") as f:
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf, pos = self.buf, 0

        def take(fmt: str):
            nonlocal pos
            value = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return value[0]

        def string() -> str:
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

        def skip(kind: int) -> None:
            nonlocal pos
            if kind == _STRING:
                n = take("Q")  # not `pos += take(...)`: that reads pos before take() moves it
                pos += n
            elif kind == _ARRAY:
                inner, count = take("I"), take("Q")
                if inner in _SCALAR:
                    pos += count * struct.calcsize(_SCALAR[inner])
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                pos += struct.calcsize(_SCALAR[kind])

        if take("4s") != b"GGUF":
            raise ValueError(f"{str(path)!r} is not a GGUF file")
        version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
        if version < 2:
            raise ValueError(f"GGUF version {version} of {str(path)!r} is not supported")
        self.architecture, alignment = "", 32
        for _ in range(n_kv):
            key, kind = string(), take("I")
            if key == "general.architecture" and kind == _STRING:
                self.architecture = string()
            elif key == "general.alignment" and kind in _SCALAR:
                alignment = take(_SCALAR[kind])
            else:
                skip(kind)
        infos = []
        for _ in range(n_tensors):
            name, n_dims = string(), take("I")
            dims = [take("Q") for _ in range(n_dims)]
            infos.append((name, dims, take("I"), take("Q")))
        start = -(-pos // alignment) * alignment
        self.tensors: list[tuple[str, int, np.ndarray]] = []  # (name, ggml type, data as GGUFReader gives it)
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        for name, dims, qtype, offset in infos:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            shape = list(reversed(dims))  # ggml lists the fastest dimension first
            row_bytes = shape[-1] // block * size
            count = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
            raw = np.frombuffer(buf, dtype=np.uint8, count=count, offset=start + offset)
            if qtype == 0:  # F32: the values themselves
                data = raw.view(np.float32).reshape(shape)
            elif qtype == 1:
                data = raw.view(np.float16).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], row_bytes)
            self.tensors.append((name, qtype, data))


_CHUNK_BLOCKS = 8192  # blocks decoded per task: a few MB of temporaries each


def decode(data: np.ndarray, qtype: int, pool: ThreadPoolExecutor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """A GGUF tensor's values as float32 ``[..., cols]``, bit-equal to ``gguf.dequantize(data, qtype)``.

    ``data`` is the tensor as ``GGUFReader`` (or :class:`_Header`) gives it: uint8 ``[..., row_bytes]`` for block
    types, the values for F32/F16. Block types run gguf's own ``dequantize_blocks`` (elementwise per block, so
    the same values) over chunks of blocks written straight into one output buffer, in ``pool``'s threads (numpy
    releases the GIL): gguf's ``dequantize`` decodes groups of 16 rows and concatenates them, which cost about
    as much again as the decoding here. With ``out`` (a contiguous tensor of as many elements, any dtype) each
    chunk is cast into it as it is decoded (a bf16 model's weight, without a float32 copy of the whole tensor),
    and ``out`` is returned as it was shaped."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize
    from gguf import quants

    kind = GGMLQuantizationType(qtype)
    block, size = GGML_QUANT_SIZES[kind]
    count = data.size // size * block if data.dtype == np.uint8 else data.size
    if out is not None and (out.numel() != count or not out.is_contiguous()):
        raise ValueError(f"decode: out has {out.numel()} elements (contiguous: {out.is_contiguous()}), "
                         f"the tensor {count}")
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = torch.from_numpy(np.array(data, dtype=np.float32))  # a copy: the memory map is read-only
        return values if out is None else out.copy_(values.reshape(out.shape))
    decoder = getattr(quants, kind.name, None)
    if decoder is None or getattr(decoder, "grid_hex", None) is not None:  # grid types need gguf's set-up
        values = torch.from_numpy(gguf_dequantize(data, kind))
        return values if out is None else out.copy_(values.reshape(out.shape))
    shape = (*data.shape[:-1], data.shape[-1] // size * block)
    blocks = np.asarray(data).reshape(-1, size)
    result = torch.empty(shape, dtype=torch.float32) if out is None else out
    flat = result.view(-1)
    # the pool's threads do not inherit the caller's inference mode, and an inference tensor is written only in it
    inference = torch.is_inference_mode_enabled()

    def run(start: int) -> None:
        stop = min(start + _CHUNK_BLOCKS, blocks.shape[0])
        values = decoder.dequantize_blocks(blocks[start:stop])
        with torch.inference_mode(inference):
            flat[start * block:stop * block] = torch.from_numpy(
                np.ascontiguousarray(values, dtype=np.float32).reshape(-1))

    starts = range(0, blocks.shape[0], _CHUNK_BLOCKS)
    if pool is None or len(starts) == 1:
        for start in starts:
            run(start)
    else:
        list(pool.map(run, starts))
    return result


def gguf_architecture(path: str | Path) -> str:
    """The ``general.architecture`` of GGUF file ``path`` (read from its header, without its other metadata)."""
    return _Header(path).architecture


def _weights_map(model: torch.nn.Module, arch: str) -> dict[str, str]:
    """GGUF tensor name -> parameter name, as transformers' ``get_gguf_hf_weights_map`` maps a Llama/Qwen2 model
    (whose top-level map covers every parameter), with gguf's name map built once instead of once per submodule."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    key = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    name_map = get_tensor_name_map(key, model.config.num_hidden_layers)
    out = {}
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base) if suffix in ("weight", "bias") else name_map.get_name(hf_name)
        if gguf_name is not None:
            out[gguf_name + ("." + suffix if suffix in ("weight", "bias") else "")] = hf_name
    return out


CODED = ("int4", "q4", "file", "q8")
"""The quantizations whose matrices can take a GGUF file's codes unchanged (:func:`speculant.models.loading.quantize_loaded`)."""


def code_kind(qtype: int, quantization: str, six: bool = True) -> tuple[str, bool]:
    """The kind of matrix that keeps a GGUF tensor of ggml type ``qtype`` in a model quantized to ``quantization``
    (one of :data:`CODED`: Q6_K in q6 where the model holds q6, as ``file`` does; another wide type in q8 where the model
    holds q8, as ``file`` and q8 do; else the quantization's matrix kind), and whether it takes the file's codes unchanged
    (Q6_K in q6; codes with a scale and minimum per 32, of at most the kind's bits: :data:`CODE_TYPES`) rather than
    being requantized from its values. ``six=False``: Q6_K as the other wide types (q8 in ``file``, requantized)."""
    from ..core.quant import BITS, HOLDS, MATRIX_KIND

    if qtype == Q6_K and six and "q6" in HOLDS[quantization]:
        return "q6", True
    kind = "q8" if qtype in WIDE_TYPES and "q8" in HOLDS[quantization] else MATRIX_KIND.get(quantization, quantization)
    return kind, qtype in CODE_TYPES and CODE_TYPES[qtype][2] <= BITS[kind]


def coded_weights(path: str | Path, config, quantization: str) -> set[str]:
    """The parameter names of the quantized linears (:func:`speculant.core.quant.quantized_linears`) of ``config``'s
    model whose tensors in GGUF file ``path`` a model quantized to ``quantization`` takes as codes
    (:func:`code_kind`): what :func:`load_gguf_model` need not decode before
    :func:`speculant.models.loading.quantize_loaded` (their float values would be dropped, or overwritten by the
    matrix's own for a tied head). Empty for a quantization outside :data:`CODED`."""
    if quantization not in CODED:
        return set()
    from transformers import AutoModelForCausalLM

    from ..core.quant import quantized_linears

    with torch.device("meta"):  # shapes and names only
        skeleton = AutoModelForCausalLM.from_config(config)
    skeleton.tie_weights()
    linear = {id(m.weight) for m in quantized_linears(skeleton)}
    params = dict(skeleton.named_parameters())
    header = _Header(path)
    names = _weights_map(skeleton, header.architecture)
    return {names[n] for n, qtype, data in header.tensors
            if data.ndim == 2 and n in names and names[n] in params and id(params[names[n]]) in linear
            and code_kind(qtype, quantization)[1]}


def load_gguf_model(path: str | Path, config, dtype: torch.dtype = torch.float32,
                    skip: frozenset[str] | set[str] = frozenset()) -> torch.nn.Module:
    """The causal LM of ``config`` (what transformers derives from the GGUF file ``path``) with the file's weights,
    dequantized and cast to ``dtype`` one tensor at a time, bit-identical to transformers' own GGUF conversion
    (same decoder values, same ``TensorProcessor``, same names). Returns the model in eval mode.

    ``skip``: parameter names left undecoded (uninitialised memory, never touched): those whose quantized matrices
    the caller attaches from elsewhere (:mod:`speculant.models.matrix_cache`) and whose float weights it releases.

    Raises ValueError for an architecture outside :data:`DIRECT_ARCHITECTURES` or a file whose tensors do not
    cover the model's parameters."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    header = _Header(path)
    arch = header.architecture
    if arch not in DIRECT_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not read directly; known: {', '.join(sorted(DIRECT_ARCHITECTURES))}")
    with no_init_weights():  # every parameter is overwritten below: skip the (slow) random initialisation
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # a tied head shares the embedding's parameter: one tensor to fill, not two
    processor = _processor(arch, config)
    names = _weights_map(model, arch)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad(), ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        for name, qtype, data in header.tensors:
            if names.get(name) not in params:  # llama/qwen2 processors never rename: skip unused tensors undecoded
                continue
            if names[name] in skip:  # the caller's: its quantized matrix comes from elsewhere
                loaded.add(names[name])
                continue
            if type(processor) is TensorProcessor:  # no reordering (qwen2): decode straight into the parameter
                target = params[names[name]]
                decode(data, qtype, pool, out=target.data)  # cast per chunk, as transformers casts per tensor
                loaded.add(names[name])
                continue
            values = decode(data, qtype, pool)  # float32 [rows, cols], equal to gguf.dequantize
            decoded = values.numpy()
            result = processor.process(weights=decoded, name=name, tensor_key_mapping=names,
                                       parsed_parameters={"tensors": {}})
            target = params.get(names.get(result.name, ""))
            if target is None:
                continue
            if result.weights is not decoded:  # reordered (Llama's Q/K rows)
                values = torch.from_numpy(np.ascontiguousarray(result.weights))
            if values.numel() != target.numel():
                raise ValueError(f"GGUF tensor {name} has {values.numel()} values; "
                                 f"{names[result.name]} needs {target.numel()}")
            values = values.reshape(target.shape)
            if target.dtype == values.dtype:
                target.data = values  # float32: take the decoded buffer itself (the empty one is never touched)
            else:
                target.copy_(values)  # cast, as transformers' loader does after dequantizing
            loaded.add(names[result.name])
    missing = [n for n in params if n not in loaded and not _tied(model, n)]
    if missing:
        raise ValueError(f"GGUF file {str(path)!r} has no tensors for {', '.join(missing[:3])}"
                         + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    model.tie_weights()
    model.eval()
    return model


def _tied(model: torch.nn.Module, name: str) -> bool:
    """True for the output head of a model whose head shares the input embedding's weight."""
    out = model.get_output_embeddings()
    return (out is not None and name.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)
            and out.weight is model.get_input_embeddings().weight)
