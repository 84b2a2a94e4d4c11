"""Our DCP planners. Save: each :class:`~mfsdp_ckpt.sharded.state.FlatEntry` becomes one write item per
box, whose data is a view of the flat shard; every item's payload gets a crc32c. Load: the read
items are planned from the target boxes against the saved chunks by overlap (DCP's own
``create_read_items_for_chunk_list``), so any saved layout loads into any target layout.
No collectives in planning beyond DCP's own gather / scatter of plans."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)

from mfsdp_ckpt.format.checksum import chunk_id, payload_crc32c
from mfsdp_ckpt.read.indexed import narrowed
from mfsdp_ckpt.sharded.state import FlatEntry

__all__ = ["MfsdpSavePlanner", "MfsdpLoadPlanner", "payload_crc32c", "chunk_id"]


class MfsdpSavePlanner(DefaultSavePlanner):
    """Plans boxes of flat shards; other values (scalar tensors, objects) as DCP does."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.checksums: dict[str, int] = {}

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for key, value in self.state_dict.items():
            if not isinstance(value, FlatEntry):
                items.extend(_create_write_items(key, value))
                continue
            properties = TensorProperties.create_from_tensor(value.tensor)
            for box in value.boxes():
                offsets = torch.Size(box.offsets)
                self._views[(key, box.offsets)] = value.view(box)
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box.sizes)),
                            properties=properties,
                            size=value.shape,
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        view = self._views.get((index.fqn, tuple(index.offset or ())))
        if view is not None:
            return view
        return super().lookup_object(index)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.device.type != "cpu":
            data = data.cpu()  # the writer needs host memory anyway; checksum that copy
        self.checksums[chunk_id(write_item.index)] = payload_crc32c(data)
        return data


class MfsdpLoadPlanner(DefaultLoadPlanner):
    """Reads into :class:`FlatEntry` targets (by box), whole tensors, and objects (bytes, loaded
    with ``weights_only=True``: a checkpoint never runs code)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self._targets: dict[tuple[str, int], torch.Tensor] = {}
        self.objects: dict[str, Any] = {}

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict = state_dict
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        requests: list[ReadItem] = []
        for key, value in self.state_dict.items():
            md = self.metadata.state_dict_metadata[key]
            if isinstance(value, FlatEntry):
                md = narrowed(md, value.start, value.end)  # an index's entry: only the chunks read
                boxes = value.boxes()
                chunks = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in boxes]
                for i, box in enumerate(boxes):
                    self._targets[(key, i)] = value.view(box)
                requests += create_read_items_for_chunk_list(key, md, chunks)
            elif isinstance(value, torch.Tensor):
                chunk = ChunkStorageMetadata(torch.Size([0] * value.dim()), value.size())
                self._targets[(key, 0)] = value
                requests += create_read_items_for_chunk_list(key, md, [chunk])
            else:
                requests += _create_read_items(key, md, value)
        self.plan = LoadPlan(requests)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._targets[(index.fqn, index.index)]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # targets are views: the data is already in place
