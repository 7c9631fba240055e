"""loadtest/kv_memory.py counts sequences through the engine's block manager: a sequence one
token past a block boundary takes one more block, so fewer of them fit."""

from __future__ import annotations

from loadtest.kv_memory import admitted


def test_admitted_counts_whole_blocks_per_sequence():
    assert admitted(num_blocks=10, block_size=16, seq_len=32) == 5  # 2 blocks each
    assert admitted(num_blocks=10, block_size=16, seq_len=33) == 3  # 3 blocks each
    assert admitted(num_blocks=2, block_size=16, seq_len=33) == 0
