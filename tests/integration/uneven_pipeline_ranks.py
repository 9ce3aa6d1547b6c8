"""A rank of tests/integration/test_uneven_pipeline_cpu.py: layer_major_ranks.py's passes (megatron-core's 1F1B
schedule, then the layer-major step with the params resident, and away while released with the inputs in host
memory) at PP2 with stages of unequal layers. Our flags make none (--num-layers must be a multiple of
--pipeline-model-parallel-size): the split is set on megatron-core's TransformerConfig the rank builds its model
from, as Megatron-LM's --decoder-first-pipeline-num-layers and the like would. Adds the layers this rank built to
its OUT/rank<N>.json.

    python uneven_pipeline_ranks.py OUT MICRO_BATCHES PRECISION SPLIT   (SPLIT: JSON of TransformerConfig fields)
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import layer_major_ranks  # noqa: E402


def main(out: str, micro_batches: int, precision: str, split: dict) -> None:
    import torch
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron.training import training
    from megatron.training.model import configs

    # layer_major_ranks.main imports both when it runs: it builds through these.
    make_config, build_model, built = configs.transformer_config, training.build_model, []

    def uneven_config(args):
        config = make_config(args)
        for field, value in split.items():
            setattr(config, field, value)
        return config

    def counted_model(*args, **kwargs):
        model = build_model(*args, **kwargs)
        built.append(sum(isinstance(module, TransformerLayer) for module in model[0].modules()))
        return model

    configs.transformer_config, training.build_model = uneven_config, counted_model
    layer_major_ranks.main(out, 1, micro_batches, precision, 2)
    result = Path(out, f"rank{torch.distributed.get_rank()}.json")
    result.write_text(json.dumps({**json.loads(result.read_text()), "layers": built[0]}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
