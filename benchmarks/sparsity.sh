#!/usr/bin/env bash
# Dense vs 50% and 75% unstructured sparsity (gradual magnitude and static random) at equal steps:
# tiny GPT on the embedded corpus, 2BW over 2 CPU processes. Prints final validation loss side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
run() {  # name, overrides...
  local name=$1; shift
  .venv/bin/pd2bw-train model=gpt_tiny data.seq_len=64 trainer.max_steps=$STEPS trainer.val_check_interval=$STEPS \
    trainer.limit_val_batches=32 trainer.enable_progress_bar=false trainer.enable_checkpointing=false \
    paths.output_dir=outputs/sparsity-$name "$@" > outputs/sparsity-$name.log 2>&1
  python3 -c "import json; s=json.load(open('outputs/sparsity-$name/summary.json')); print(f\"{'$name':<16} steps {s['global_step']}  val_loss {s['val_loss']:.4f}  density {s.get('sparsity/density', 1.0):.3f}  train_flops_vs_dense {s.get('sparsity/flops_ratio', 1.0):.3f}\")"
}
mkdir -p outputs
run dense sparsity=none
for s in 0.5 0.75; do
  run gradual-$s sparsity=gradual sparsity.sparsity=$s sparsity.start_step=0 sparsity.end_step=$((STEPS * 6 / 10)) \
    sparsity.allocation=uniform  # the cubic rise over the first 60%, uniform: the defaults before 0.4.1
  run static-$s sparsity=static sparsity.sparsity=$s
done
