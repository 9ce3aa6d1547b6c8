# The flags shared by upstream Megatron-LM and this repo in benchmarks/experiments/upstream_checkpoint.sh and
# tests/integration/test_upstream_megatron_checkpoint.py: a tiny Llama-style GPT on tests/data/upstream_gpt.
D=${UPSTREAM_DATA:-tests/data/upstream_gpt}
UPSTREAM_COMMON="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
 --disable-bias-linear --seq-length 128 --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8
 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
 --adam-beta2 0.95 --attention-dropout 0 --hidden-dropout 0 --bf16 --use-distributed-optimizer
 --tokenizer-type GPT2BPETokenizer --vocab-file $D/vocab.json --merge-file $D/merges.txt
 --data-path $D/corpus_text_document --split 100,0,0 --eval-iters 0 --eval-interval 1000 --seed 1234 --log-interval 1
 --ckpt-format torch_dist --train-iters 8 --save-interval 4"
