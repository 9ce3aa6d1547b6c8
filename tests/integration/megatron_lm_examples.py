"""The flag sets of two Megatron-LM example scripts (tag core_v0.16.1, the megatron-core we run on),
scaled down to the tiny CPU model: sizes, batch and sample counts shrink; every flag stays.

- examples/gpt3/train_gpt3_175b_distributed.sh
- examples/llama/train_llama3_8b_h100_fp8.sh (its --mock-data branch)

Kept unchanged in meaning, only smaller: each scaled value says what it was. ``{ckpt}`` and
``{cache}`` are filled with temporary directories by the tests.

Dropped for now, owned by the other helpers of issue 12 (to be re-added after their merge):
- tokenizer/data: --vocab-file, --merge-file, --tokenizer-type NullTokenizer, --tiktoken-pattern v2,
  --no-create-attention-mask-in-dataloader, --no-mmap-bin-files
- logs/metrics: --tensorboard-dir, --log-throughput
- checkpoints: --ckpt-format torch_dist
--data-path is replaced by --mock-data (as the brief of the CPU runs says).
"""

GPT3_175B = [
    # GPT_MODEL_ARGS
    "--num-layers", "4",  # 96
    "--hidden-size", "64",  # 12288
    "--num-attention-heads", "4",  # 96
    "--seq-length", "64",  # 2048
    "--max-position-embeddings", "64",  # 2048
    "--attention-backend", "auto",
    # TRAINING_ARGS
    "--micro-batch-size", "1",
    "--global-batch-size", "8",  # 1536
    "--rampup-batch-size", "2", "2", "8",  # 16 16 5859375
    "--train-iters", "2",  # 500000
    "--weight-decay", "0.1",
    "--adam-beta1", "0.9",
    "--adam-beta2", "0.95",
    "--init-method-std", "0.006",
    "--clip-grad", "1.0",
    "--fp16",
    "--lr", "6.0e-5",
    "--lr-decay-style", "cosine",
    "--min-lr", "6.0e-6",
    "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "430000",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "1",  # 8
    "--pipeline-model-parallel-size", "2",  # 16
    # DATA_ARGS
    "--mock-data",  # --data-path $DATA_PATH
    "--split", "949,50,1",
    # EVAL_AND_LOGGING_ARGS
    "--log-interval", "100",
    "--save-interval", "10000",
    "--eval-interval", "1000",
    "--save", "{ckpt}",
    "--load", "{ckpt}",
    "--eval-iters", "10",
]

# Flags of the Llama example that need what a CPU run lacks (transformer-engine on CUDA), or that
# this training layer does not support yet: each must fail with one line naming it.
LLAMA3_8B_NEEDS_GPU = {
    "--attention-backend": ["--attention-backend", "fused"],
    "--apply-layernorm-1p": ["--apply-layernorm-1p"],
    "--fp8-format": ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
                     "--fp8-param-gather"],
}

LLAMA3_8B_CPU = [
    # MODEL_ARGS
    "--use-mcore-models",
    "--num-layers", "4",  # 32
    "--hidden-size", "64",  # 4096
    "--ffn-hidden-size", "224",  # 14336 (3.5 x hidden)
    "--num-attention-heads", "4",  # 32
    "--group-query-attention",
    "--num-query-groups", "2",  # 8
    "--kv-channels", "16",  # 128 (hidden / heads)
    "--seq-length", "64",  # 8192
    "--max-position-embeddings", "64",  # 8192
    "--position-embedding-type", "rope",
    "--rotary-base", "1000000",
    "--rotary-percent", "1.0",
    "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0",
    "--swiglu",
    "--normalization", "RMSNorm",
    "--init-method-std", "0.0134",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    # TRAINING_ARGS
    "--micro-batch-size", "1",
    "--global-batch-size", "8",  # 128
    "--train-samples", "16",  # 1953125000
    "--lr-decay-samples", "15",  # 1949218748
    "--lr-warmup-samples", "1",  # 3906252
    "--lr", "0.00015",
    "--min-lr", "0.00001",
    "--decoupled-lr", "5.0e-4",
    "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine",
    "--clip-grad", "1.0",
    "--weight-decay", "0.1",
    "--adam-beta1", "0.9",
    "--adam-beta2", "0.95",
    "--bf16",
    "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss",
    "--manual-gc",
    "--empty-unused-memory-level", "1",
    "--exit-duration-in-mins", "235",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "1",
    "--context-parallel-size", "1",
    "--sequence-parallel",
    # DDP_ARGS
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    # DATA_ARGS_LIST (mock branch)
    "--mock-data",
    "--vocab-size", "384",  # 128256
    "--data-cache-path", "{cache}",
    "--split", "99,1,0",  # the script passes "'99,1,0'" (quotes and all, after word splitting)
    "--num-workers", "1",
    # EVAL_AND_LOGGING_ARGS
    "--log-interval", "1",
    "--eval-iters", "1",  # 32
    "--eval-interval", "100",
    "--save-interval", "1000",
    "--profile",
    "--profile-step-start", "0",  # 4 (the run is 2 iterations)
    "--profile-step-end", "1",  # 6
    "--distributed-timeout-minutes", "60",
    "--save", "{ckpt}",
    "--load", "{ckpt}",
]


def filled(flags, ckpt, cache="unused"):
    return [flag.format(ckpt=ckpt, cache=cache) for flag in flags]


# examples/mixtral/train_mixtral_8x7b_distributed.sh (Megatron-LM main, 2026), scaled down; data by
# --mock-data as above (its --tokenizer-type Llama2Tokenizer --tokenizer-model and --data-path dropped).
MIXTRAL_8X7B = [
    # MODEL_ARGS
    "--use-mcore-models",
    "--disable-bias-linear",
    "--seq-length", "64",  # 4096
    "--max-position-embeddings", "256",  # 32768
    "--num-layers", "2",  # 32
    "--hidden-size", "64",  # 4096
    "--ffn-hidden-size", "224",  # 14336
    "--num-attention-heads", "4",  # 32
    "--init-method-std", "0.01",
    "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0",
    "--normalization", "RMSNorm",
    "--position-embedding-type", "rope",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups", "2",  # 8
    "--no-masked-softmax-fusion",
    "--no-position-embedding",
    "--rotary-base", "1000000",
    # MOE_ARGS
    "--num-experts", "4",  # 8
    "--moe-router-topk", "2",
    "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2",
    "--moe-grouped-gemm",
    "--moe-token-dispatcher-type", "alltoall",
    "--overlap-param-gather",
    "--overlap-grad-reduce",
    # DATA_ARGS
    "--mock-data",
    "--split", "99990,8,2",
    # TRAINING_ARGS
    "--micro-batch-size", "1",
    "--global-batch-size", "4",  # 256
    "--lr", "1e-4",
    "--train-iters", "2",  # 500000
    "--lr-decay-iters", "320000",
    "--lr-decay-style", "cosine",
    "--min-lr", "1.0e-5",
    "--weight-decay", "0.1",
    "--lr-warmup-iters", "1",  # 500
    "--clip-grad", "1.0",
    "--bf16",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "1",
    "--pipeline-model-parallel-size", "1",  # 4
    "--expert-model-parallel-size", "2",  # 8
    "--use-distributed-optimizer",
    "--sequence-parallel",
    # LOGGING_ARGS
    "--log-interval", "1",
    "--save-interval", "10000",
    "--eval-interval", "1000",
    "--eval-iters", "1",  # 10
    "--save", "{ckpt}",
    "--load", "{ckpt}",
    "--tensorboard-dir", "{ckpt}/tensorboard",
    "--no-load-optim",
    "--no-load-rng",
]

# examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh's MODEL_ARGS, scaled down, with the
# training a pretraining run needs (the config gives none: lr, iterations, batch).
QWEN3_30B_A3B = [
    "--save-interval", "100000",
    "--micro-batch-size", "1",
    "--bf16",
    "--no-masked-softmax-fusion",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--position-embedding-type", "rope",
    "--no-rope-fusion",
    "--normalization", "RMSNorm",
    "--swiglu",
    "--num-layers", "2",  # 48
    "--hidden-size", "64",  # 2048
    "--ffn-hidden-size", "192",  # 6144
    "--num-attention-heads", "4",  # 32
    "--group-query-attention",
    "--num-query-groups", "2",  # 4
    "--kv-channels", "16",  # 128
    "--qk-layernorm",
    "--num-experts", "8",  # 128
    "--moe-ffn-hidden-size", "32",  # 768
    "--moe-router-topk", "4",  # 8
    "--moe-router-dtype", "fp32",
    "--moe-aux-loss-coeff", "1e-3",
    "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-load-balancing-type", "aux_loss",
    "--seq-length", "64",  # 4096
    "--max-position-embeddings", "256",  # 40960
    "--make-vocab-size-divisible-by", "1187",
    "--use-mcore-models",
    "--rotary-percent", "1.0",
    "--rotary-base", "1000000",
    "--no-bias-swiglu-fusion",
    "--sequence-parallel",
    # for a pretraining run
    "--mock-data", "--vocab-size", "384",
    "--expert-model-parallel-size", "2",
    "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4", "--log-interval", "1",
    "--use-distributed-optimizer", "--num-workers", "0", "--save", "{ckpt}",  # its scripts pass --save
]

# What a model-optimizer config lacks for pretraining (it gives no lr, iterations or batch); data by
# --mock-data --vocab-size in place of its --tokenizer-type HuggingFaceTokenizer.
FOR_A_PRETRAINING_RUN = [
    "--mock-data", "--vocab-size", "384",
    "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4", "--log-interval", "1",
    "--use-distributed-optimizer", "--num-workers", "0", "--save", "{ckpt}",
]

# examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh's MODEL_ARGS (Megatron-LM main,
# 2026), scaled down: multi-latent attention with MoE and shared experts.
DEEPSEEK_V2_LITE = [
    "--save-interval", "100000",
    "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0",
    "--micro-batch-size", "1",
    "--bf16",
    "--no-masked-softmax-fusion",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--position-embedding-type", "rope",
    "--no-rope-fusion",
    "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6",
    "--swiglu",
    "--num-layers", "2",  # 27
    "--hidden-size", "64",  # 2048
    "--ffn-hidden-size", "192",  # 10944
    "--num-attention-heads", "4",  # 16
    "--kv-channels", "16",
    "--multi-latent-attention",
    "--kv-lora-rank", "16",  # 512
    "--v-head-dim", "16",  # 128
    "--qk-head-dim", "16",  # 128
    "--qk-layernorm",
    "--qk-pos-emb-head-dim", "8",  # 64
    "--num-experts", "4",  # 64
    "--moe-layer-freq", "([0]+[1]*1)",  # ([0]+[1]*26)
    "--moe-ffn-hidden-size", "32",  # 1408
    "--moe-grouped-gemm",
    "--moe-router-score-function", "softmax",
    "--moe-router-topk", "2",  # 6
    "--moe-router-topk-scaling-factor", "1.0",
    "--moe-router-pre-softmax",
    "--moe-shared-expert-intermediate-size", "64",  # 2816
    "--moe-aux-loss-coeff", "1e-3",
    "--moe-token-dispatcher-type", "alltoall",
    "--moe-token-drop-policy", "probs",
    "--moe-router-load-balancing-type", "seq_aux_loss",
    "--seq-length", "32",  # 1024
    "--max-position-embeddings", "32",  # 1024
    "--make-vocab-size-divisible-by", "128",  # 3200
    "--attention-softmax-in-fp32",
    "--use-mcore-models",
    "--rotary-percent", "1.0",
    "--rotary-base", "10000",
    "--rotary-scaling-factor", "40",
    "--mscale", "0.707",
    "--mscale-all-dim", "0.707",
    "--sequence-parallel",
    *FOR_A_PRETRAINING_RUN,
]

# examples/post_training/modelopt/conf/Qwen/Qwen2.5-7B-Instruct.sh's MODEL_ARGS, scaled down: QKV
# biases without other linear biases, an explicit padded vocabulary.
QWEN2_5_7B = [
    "--save-interval", "100000",
    "--micro-batch-size", "1",
    "--bf16",
    "--no-masked-softmax-fusion",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--position-embedding-type", "rope",
    "--no-rope-fusion",
    "--normalization", "RMSNorm",
    "--swiglu",
    "--num-layers", "2",  # 28
    "--hidden-size", "64",  # 3584
    "--ffn-hidden-size", "224",  # 18944
    "--num-attention-heads", "4",  # 28
    "--group-query-attention",
    "--num-query-groups", "2",  # 4
    "--kv-channels", "16",  # 128
    "--seq-length", "32",  # 4096
    "--max-position-embeddings", "256",  # 32768
    "--padded-vocab-size", "400",  # 152064
    "--make-vocab-size-divisible-by", "1",
    "--use-mcore-models",
    "--rotary-percent", "1.0",
    "--rotary-base", "1000000",
    "--no-bias-swiglu-fusion",
    "--untie-embeddings-and-output-weights",
    *FOR_A_PRETRAINING_RUN,
]

# The model-optimizer configs of Llama-4 Scout and Qwen3-235B-A22B: the flags that stopped them
# (each with the sizes scaled as above). Qwen3-235B's parse now; Llama-4's export flags are refused.
QWEN3_235B_A22B_EXTRA = ["--rotary-seq-len-interpolation-factor", "1", "--moe-layer-recompute"]
LLAMA4_SCOUT_EXTRA = ["--rotary-interleaved", "--rotary-base", "500000", "--rope-scaling-factor", "8.0",
                      "--use-rope-scaling", "--padded-vocab-size", "512", "--moe-router-score-function", "sigmoid",
                      "--moe-router-topk", "1", "--moe-shared-expert-intermediate-size", "64",
                      "--moe-router-load-balancing-type", "seq_aux_loss"]
LLAMA4_EXPORT_FLAGS = ["--export-qk-l2-norm", "--export-moe-apply-probs-on-input"]
