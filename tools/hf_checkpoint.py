"""Hugging Face checkpoints in and out of this project's format.

    python tools/hf_checkpoint.py import HF_DIR CKPT_DIR [--tensor-model-parallel-size N
                                         --pipeline-model-parallel-size N --expert-model-parallel-size N]
    python tools/hf_checkpoint.py export CKPT_DIR HF_DIR [--hf-template DIR] [--shard-gb 5]

``import`` reads HF_DIR (config.json, safetensors weights, tokenizer files) and writes CKPT_DIR: a
torch_dist checkpoint of the weights only, the model's flags in CKPT_DIR/model_args.txt and
config.json with the tokenizer files in CKPT_DIR/hf. Fine-tune it with

    torchrun ... pretrain_gpt.py $(cat CKPT_DIR/model_args.txt) --finetune --load CKPT_DIR \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model CKPT_DIR/hf ...

``export`` writes the newest complete checkpoint of CKPT_DIR (any TP/PP/EP, offloaded optimizer state
or not: only the weights are read) as a directory transformers' ``from_pretrained`` loads. Both
stream a tensor at a time (see docs/hf_checkpoints.md) and draw a progress line on stderr.
"""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="a Hugging Face directory into a new checkpoint directory")
    imp.add_argument("hf_dir", help="config.json, *.safetensors (one, or sharded with their index), tokenizer files")
    imp.add_argument("ckpt_dir", help="a new (or empty) directory")
    for flag, what in (("--tensor-model-parallel-size", "TP"), ("--pipeline-model-parallel-size", "PP"),
                       ("--expert-model-parallel-size", "EP")):
        imp.add_argument(flag, type=int, default=1,
                         help=f"the {what} training will use: checked against the model's sizes (the checkpoint "
                              "itself loads at any)")
    exp = commands.add_parser("export", help="a checkpoint directory into a new Hugging Face directory")
    exp.add_argument("ckpt_dir", help="a --save directory: its newest complete checkpoint is exported")
    exp.add_argument("hf_dir", help="a new (or empty) directory")
    exp.add_argument("--hf-template", default=None,
                     help="the Hugging Face directory (config.json, tokenizer) the checkpoint's model came from; "
                          "default: CKPT_DIR/hf, else the hf/ of the import the checkpoint's --load named")
    exp.add_argument("--shard-gb", type=float, default=5.0, help="the largest safetensors file, in GB")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron.training.errors import UserError

    try:
        from megatron.training.hf import convert

        if args.command == "import":
            flags = convert.import_checkpoint(args.hf_dir, args.ckpt_dir, args.tensor_model_parallel_size,
                                              args.pipeline_model_parallel_size, args.expert_model_parallel_size)
            print(f"imported {args.hf_dir} into {args.ckpt_dir}; its model's flags ({len(flags)} words) are in "
                  f"{os.path.join(args.ckpt_dir, convert.MODEL_ARGS)}")
        else:
            path = convert.export_checkpoint(args.ckpt_dir, args.hf_dir, args.hf_template, args.shard_gb)
            print(f"exported {path} to {args.hf_dir}")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
