"""The layer-major step (megatron/training/model/layer_major.py) over two pipeline stages of unequal layers, against
megatron-core's 1F1B schedule with full recompute: the same losses and every gradient bit for bit, with the params
resident, and away while released with the layer inputs in host memory. The split is megatron-core's
TransformerConfig's (uneven_pipeline_ranks.py); pretrain_gpt.py takes it from Megatron-LM's flags (test_layer_major_cpu.py)."""

import json

import pytest

from launch import REPO, launch_command, pretrain_env, run_and_clean_up
from tests.profiles import cases

RANKS = REPO / "tests" / "integration" / "uneven_pipeline_ranks.py"

# (fields set on the config, layers of stage 0 and of stage 1): --num-layers 4, or 3 where the embedding or the
# loss takes a layer's place in the split.
SPLITS = [({"num_layers_in_first_pipeline_stage": 1}, (1, 3)),
          ({"num_layers_in_last_pipeline_stage": 1}, (3, 1)),
          ({"num_layers": 3, "account_for_embedding_in_pipeline_split": True}, (1, 2)),
          ({"num_layers": 3, "account_for_loss_in_pipeline_split": True}, (2, 1))]
CASES = cases([(json.dumps(fields), stages, precision) for fields, stages in SPLITS for precision in ("fp32", "bf16")],
              ci_keep=1)


@pytest.mark.parametrize("fields, stages, precision", CASES, ids=[f"{s[0]}-{s[1]}-{p}" for _, s, p in CASES])
def test_layer_major_step_over_uneven_stages_equals_megatron_cores_schedule(tmp_path, fields, stages, precision):
    cmd = launch_command([str(tmp_path), "3", precision, fields], 2, warm=True, script=RANKS)
    code, output = run_and_clean_up(cmd, pretrain_env(), 240, tmp_path / "out.txt")
    assert code == 0, output[-4000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert tuple(r["layers"] for r in results) == stages
    assert [len(r["losses"]) for r in results] == [0, 3]  # the last stage reports the three micro-batches' losses
    for r in results:
        assert r["losses"] == r["reference_losses"] == r["streamed_losses"], r
        assert r["grads_equal"] and r["streamed_grads_equal"] and r["calls_in_order"], r
        assert r["nonzero_grads"] > r["grad_elements"] // 2, r  # a real backward reached them
