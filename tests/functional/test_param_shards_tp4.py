"""The parameter-sharding mechanism over a 4-rank TP group.

Every rank's rows are written out by hand from Megatron's padded layout (vocab 10 over
TP 4: ``V_local = ceil(10 / 4) = 3``, rank r holds ``[3r, 3r + 3)``, rank 3 one real row
and two padding rows); linear weights split 8 rows / 8 columns into 2 per rank. Loads
are exact copies and gathers exact concatenations, so comparisons are exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mp_bridge.layers import VocabParallelEmbedding, VocabParallelLMHead, VocabShard
from mp_bridge.models import gather_full_state, load_full_state
from mp_bridge.models.parallel.tp_blocks import column_linear, parallel_config, row_linear
from mp_bridge.testing import DistributedWorld, current_device

world = DistributedWorld(4, timeout_s=120)

#: rank -> (start, stop, real rows) of vocab 10 over TP 4.
VOCAB_ROWS = {0: (0, 3, 3), 1: (3, 6, 3), 2: (6, 9, 3), 3: (9, 12, 1)}


@world.case
def test_vocab_layers_load_and_gather_their_hand_written_rows():
    group, rank = dist.group.WORLD, dist.get_rank()
    start, stop, real = VOCAB_ROWS[rank]
    dev = current_device()
    full = torch.arange(20.0, device=dev).view(10, 2)
    emb = VocabParallelEmbedding.from_full(full, tp_group=group)  # on full's device
    assert emb.vocab_shard == VocabShard(start, stop, 10, 12)
    want = torch.zeros(3, 2, device=dev)
    want[:real] = full[start : start + real]
    assert torch.equal(emb.weight.detach(), want)
    head = VocabParallelLMHead(2, 10, tp_group=group, bias=True, device=dev)
    load_full_state(head, {"weight": full, "bias": torch.arange(10.0, device=dev)})
    assert torch.equal(head.weight.detach(), want)
    assert head.bias.tolist() == [float(i) if i < 10 else 0.0 for i in range(start, stop)]
    back = gather_full_state(head)
    assert torch.equal(back["weight"], full) and back["bias"].tolist() == list(range(10))


@world.case
def test_megatron_linears_use_the_same_declaration():
    group, rank = dist.group.WORLD, dist.get_rank()
    config = parallel_config(group)
    module = nn.Module()
    module.col = column_linear(4, 8, tp_group=group, config=config)  # rows split
    module.row = row_linear(8, 4, tp_group=group, config=config)  # columns split
    dev = current_device()
    module.to(dev)  # megatron's linears are built on the CPU (use_cpu_initialization)
    col_full = torch.arange(32.0, device=dev).view(8, 4)
    row_full = torch.arange(32.0, device=dev).view(4, 8)
    load_full_state(module, {"col.weight": col_full, "row.weight": row_full})
    assert torch.equal(module.col.weight.detach(), col_full[2 * rank : 2 * rank + 2])
    assert torch.equal(module.row.weight.detach(), row_full[:, 2 * rank : 2 * rank + 2])
    back = gather_full_state(module)
    assert torch.equal(back["col.weight"], col_full) and torch.equal(back["row.weight"], row_full)
