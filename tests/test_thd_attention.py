"""PackedDotProductAttention: a THD-packed batch equals each sequence run on its own (real GPTModel, CPU)."""

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, init_model_parallel, tiny_transformer_config
from verl_fused_hook_harness.support.distributed import run_in_processes

LENGTHS = (5, 9, 4)


def packed_vs_separate_worker(rank, world_size):
    init_model_parallel(1)
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=96)
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 96, (1, n), generator=generator) for n in LENGTHS]
    separate = torch.cat([model(seq, torch.arange(seq.shape[1])[None], None) for seq in sequences], dim=1)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = model(
        torch.cat(sequences, dim=1),
        torch.cat([torch.arange(n) for n in LENGTHS])[None],
        None,
        packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=9, max_seqlen_kv=9
        ),
    )
    return (packed - separate).abs().max().item(), separate.abs().max().item()


def test_packed_sequences_do_not_see_each_other():
    error, scale = run_in_processes(packed_vs_separate_worker, 1)[0]
    assert scale > 0.1 and error <= 1e-5, (error, scale)
