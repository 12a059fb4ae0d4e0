"""Placing weights on the mesh one (fused) weight at a time: float, W8A8 (``models/quant.py``) or
narrow (``models/narrow.py``), each sharded by the rules (``models/sharding.py``).

``load_model`` (``models/loading.py``) says which weight is which; the placers read, convert and
place. The host never holds more than one weight's few tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis
from jax.sharding import Mesh

from myserve.errors import CheckpointError
from myserve.models.narrow import GROUP_AXIS, NarrowWeight
from myserve.models.narrow_host import (
    QUANT_GROUP,
    BlockLayout,
    HostNarrow,
    from_blocks,
    group_size,
    layout_of,
)
from myserve.models.narrow_host import quantize as quantize_narrow
from myserve.models.quant import QuantizedWeight, quantize
from myserve.models.sharding import MeshAxes, named_sharding
from myserve.models.spec import ModelSpec


class TensorSource(Protocol):
    """Where weights come from: HF-named tensors in HF layout. A source may also have
    ``read_slice(hf_name, index) -> np.ndarray``: one part of a tensor, reading no more of the file
    than the format needs (``read_part``)."""

    spec: ModelSpec

    def has(self, hf_name: str) -> bool: ...

    def read(self, hf_name: str) -> np.ndarray: ...


def read_part(source: TensorSource, hf_name: str, index: tuple[slice, ...]) -> np.ndarray:
    """``source.read(hf_name)[index]``, read as a part where the source can (``read_slice``)."""
    read_slice = getattr(source, "read_slice", None)
    if read_slice is None or all(s == slice(None) for s in index):
        return source.read(hf_name)[index]
    return read_slice(hf_name, index)


# How each weight goes from HF layout ([out, in] projections) to our named layout. A field may fuse
# several HF tensors of one layer (q/k/v, gate/up); the host holds at most those few at a time.
Combine = Callable[..., np.ndarray]

type Split = Mapping[str, tuple[int, int | tuple[int, ...]] | str]
"""Which part of each HF tensor of a weight a part of one of its sharded axes comes from: per
logical axis, ``(hf_axis, block)``: rows ``[lo:hi]`` of the axis are ``[lo * block : hi * block]``
of every tensor's ``hf_axis`` (``block`` per tensor, or one for all); or ``"names"``: the HF names
come in equal groups, one per index of the axis (a MoE's experts). A sharded axis not named is read
whole and cut after combining. The combine must take such parts (reshape with -1 on that axis)."""


type Bounds = tuple[tuple[int, int], ...]
"""A part of an array: (start, stop) along each dimension."""


def part_bounds(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Bounds:
    """The part of an array a device's index (``Sharding.devices_indices_map``) holds."""
    assert index is not None  # every device of a sharding holds a part
    return tuple((s.start or 0, size if s.stop is None else s.stop) for s, size in zip(index, shape, strict=True))


class Placer:
    """Reads, converts and shards tensors onto the mesh one (fused) weight at a time. ``abstract``:
    reads nothing and places nothing; every weight is a ``jax.ShapeDtypeStruct`` with its sharding."""

    def __init__(
        self,
        source: TensorSource,
        mesh: Mesh,
        mapping: Mapping[str, MeshAxes],
        dtype: jnp.dtype,
        abstract: bool = False,
    ):
        self.source, self.mesh, self.mapping, self.dtype, self.abstract = source, mesh, mapping, dtype, abstract
        self.elements_read = 0
        """Elements of the HF tensors (or their parts) read so far, by this process."""

    def host(self, hf_names: tuple[str, ...], axes: tuple, combine: Combine | None = None) -> np.ndarray:
        """Read ``hf_names`` and combine them into our layout (float32 or the stored dtype), on the host."""
        expected = tuple(a.size for a in axes)
        if self.abstract:  # a zero-stride stand-in with the weight's shape: no memory, nothing read
            return np.broadcast_to(np.zeros((), np.float32), expected)
        tensors = [self.source.read(name) for name in hf_names]
        self.elements_read += sum(t.size for t in tensors)
        shapes = ", ".join(f"{n} {t.shape}" for n, t in zip(hf_names, tensors, strict=True))
        try:
            w = combine(*tensors) if combine is not None else tensors[0]
        except ValueError:  # fused tensors whose shapes do not fit together
            raise CheckpointError(f"tensor(s) {shapes} do not give the expected shape {expected}") from None
        if w.shape != expected:
            raise CheckpointError(f"tensor(s) {shapes} do not give the expected shape {expected}")
        return w

    def place(
        self,
        hf_names: tuple[str, ...],
        axes: tuple,
        combine: Combine | None = None,
        dtype: jnp.dtype | None = None,
        split: Split | None = None,
    ) -> hax.NamedArray:
        """Read, combine and place one weight. When the mesh spans several processes, each reads
        only the parts of the HF tensors that make the parts its own devices hold (``split``; one
        read per distinct part), where the source can read parts (``read_slice``): a multi-host
        server does not read every weight on every host."""
        sharding = named_sharding([a.name for a in axes], self.mapping, self.mesh)
        if self.abstract or split is None or sharding.is_fully_addressable:
            return self.put(self.host(hf_names, axes, combine), axes, dtype)
        shape = tuple(a.size for a in axes)
        parts: dict[Bounds, np.ndarray] = {}  # one read per distinct part (devices may share one)
        for index in sharding.addressable_devices_indices_map(shape).values():
            bounds = part_bounds(index, shape)
            if bounds not in parts:
                part = self._read_part(hf_names, axes, combine, split, bounds)
                parts[bounds] = np.ascontiguousarray(part.astype(dtype or self.dtype))
        return hax.named(
            jax.make_array_from_callback(shape, sharding, lambda index: parts[part_bounds(index, shape)]), axes
        )

    def _read_part(
        self, hf_names: tuple[str, ...], axes: tuple, combine: Combine | None, split: Split, bounds: Bounds
    ) -> np.ndarray:
        """The part ``bounds`` of one weight, from the parts of its HF tensors that make it."""
        keep = range(len(hf_names))
        reads: list[dict[int, slice]] = [{} for _ in hf_names]  # per HF tensor: its axis -> range
        after: list[slice] = []  # what to cut from the combined part: axes read whole
        for (start, stop), axis in zip(bounds, axes, strict=True):
            how = split.get(axis.name)
            if how is None or (start, stop) == (0, axis.size):
                after.append(slice(start, stop))
                continue
            after.append(slice(None))
            if isinstance(how, str):  # "names": one group of HF names per index
                per = len(hf_names) // axis.size
                keep = range(start * per, stop * per)
                continue
            hf_axis, block = how
            for i, read in enumerate(reads):
                b = block[i] if isinstance(block, tuple) else block
                read[hf_axis] = slice(start * b, stop * b)
        index = [tuple(read.get(a, slice(None)) for a in range(max(read, default=-1) + 1)) for read in reads]
        tensors = [read_part(self.source, hf_names[i], index[i]) for i in keep]
        self.elements_read += sum(t.size for t in tensors)
        expected = tuple(stop - start for start, stop in bounds)
        try:
            part = (combine(*tensors) if combine is not None else tensors[0])[tuple(after)]
        except ValueError:
            part = None
        if part is None or part.shape != expected:
            names = ", ".join(hf_names[i] for i in keep)
            shape = tuple(a.size for a in axes)
            raise CheckpointError(f"tensor(s) {names} do not give the expected part {expected} of shape {shape}")
        return part

    def put(self, host: np.ndarray, axes: tuple, dtype: jnp.dtype | None = None) -> hax.NamedArray:
        """Cast and place one host array on the mesh, sharded by the rules."""
        sharding = named_sharding([a.name for a in axes], self.mapping, self.mesh)
        if self.abstract:
            return hax.NamedArray(jax.ShapeDtypeStruct(host.shape, dtype or self.dtype, sharding=sharding), axes)
        array = np.ascontiguousarray(host.astype(dtype or self.dtype))
        return hax.named(jax.device_put(array, sharding), axes)

    def put_quantized(self, host: np.ndarray, axes: tuple, contracted: tuple[int, ...]) -> QuantizedWeight:
        """Quantize a matmul weight to int8 per output channel and place both parts."""
        out_axes = tuple(a for i, a in enumerate(axes) if i not in contracted)
        if self.abstract:
            scale_shape = tuple(a.size for a in out_axes)
            return QuantizedWeight(
                q=self.put(host, axes, jnp.dtype(jnp.int8)),
                scale=self.put(
                    np.broadcast_to(np.zeros((), np.float32), scale_shape), out_axes, jnp.dtype(jnp.float32)
                ),
            )
        q, scale = quantize(host, contracted)
        return QuantizedWeight(
            q=self.put(q, axes, jnp.dtype(jnp.int8)), scale=self.put(scale, out_axes, jnp.dtype(jnp.float32))
        )


def _axis_devices(mapping: Mapping[str, MeshAxes], mesh: Mesh, name: str) -> int:
    """How many devices a logical axis is split over."""
    axes = mapping.get(name)
    names = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in names], dtype=np.int64))


class NarrowPlacer(Placer):
    """Places matmul weights as ``NarrowWeight``s (``model.quantization: int8 | int4``): GGUF blocks
    of a kept type as the file holds them, anything else quantized from float here."""

    def __init__(self, *args: object, bits: int, group: int = QUANT_GROUP, kernel: bool = False, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.bits, self.group, self.kernel = bits, group, kernel

    def plan(self, every_layer: Sequence[tuple[str, ...]]) -> BlockLayout | None:
        """One layout for a field over all the layers it is read from (so every layer has the same
        structure and shapes, as the per-layer step needs, even in files mixing block types such
        as Q4_K_M's): None unless every tensor is a kept block type."""
        layouts = [getattr(self.source, "block_layout", lambda _: None)(n) for names in every_layer for n in names]
        if not layouts or any(layout is None for layout in layouts):
            return None
        return layout_of(layouts, self.bits)  # type: ignore[arg-type]

    def narrow(
        self,
        hf_names: tuple[str, ...],
        axes: tuple,
        combine: Combine | None,
        n_in: int,
        n_lead: int = 0,
        layout: BlockLayout | None = None,
        min_bits: int = 4,
    ) -> NarrowWeight:
        """Read, quantize or repack, and place one matmul weight whose axes are ``(*lead, *in, *out)``;
        ``layout``: the blocks' layout (``plan``), None to quantize from float, to at least
        ``min_bits``."""
        lead, in_axes, out = axes[:n_lead], axes[n_lead : n_lead + n_in], axes[n_lead + n_in :]
        k = int(np.prod([a.size for a in in_axes]))
        read_blocks = getattr(self.source, "read_blocks", None)
        if layout is not None:
            bits, group, offset, scale_dtype = layout.bits, layout.group, layout.offset, layout.scale_dtype
        else:
            bits = max(self.bits, min_bits)
            offset, scale_dtype = bits == 4, np.dtype(np.float32)
            shards = _axis_devices(self.mapping, self.mesh, in_axes[0].name)
            group = group_size(k, shards, self.group or k)  # 0: one group per output channel
        if self.abstract:
            host = HostNarrow(
                np.broadcast_to(np.zeros((), np.int8 if bits == 8 else np.uint8), ()),
                np.broadcast_to(np.zeros((), scale_dtype), ()),
                np.broadcast_to(np.zeros((), scale_dtype), ()) if offset else None,
                bits,
                group,
            )
        elif layout is not None and read_blocks is not None:
            parts = [read_blocks(n) for n in hf_names]
            host = from_blocks(parts, combine, n_lead, k, tuple(a.size for a in out), layout)
        else:
            w = self.host(hf_names, axes, combine)
            host = quantize_narrow(w.reshape(*w.shape[:n_lead], k, *w.shape[n_lead + n_in :]), n_lead, bits, group)
        groups = Axis(in_axes[0].name, k // group)
        code_axes = (*lead, groups, Axis(GROUP_AXIS, group // (8 // bits)), *out)
        scale_axes = (*lead, groups, *out)
        return NarrowWeight(
            codes=self.put_exact(host.codes, code_axes),
            scale=self.put_exact(host.scale, scale_axes),
            offset=None if host.offset is None else self.put_exact(host.offset, scale_axes),
            bits=bits,
            in_axes=tuple(in_axes),
            n_lead=n_lead,
            dtype=self.dtype,
            kernel=self.kernel and n_lead == 0,
        )

    def put_exact(self, host: np.ndarray, axes: tuple) -> hax.NamedArray:
        """Place a host array in its own dtype; a dimension its mesh axes do not divide is replicated."""
        shape = tuple(a.size for a in axes)
        names = [a.name if a.size % _axis_devices(self.mapping, self.mesh, a.name) == 0 else "" for a in axes]
        sharding = named_sharding(names, self.mapping, self.mesh)
        if self.abstract:
            return hax.NamedArray(jax.ShapeDtypeStruct(shape, host.dtype, sharding=sharding), axes)
        assert host.shape == shape, (host.shape, shape)
        return hax.named(jax.device_put(np.ascontiguousarray(host), sharding), axes)
