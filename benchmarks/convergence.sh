#!/usr/bin/env bash
# 2BW vs Flush at equal steps: tiny GPT, AdamW, embedded corpus, 2 CPU processes. Prints final val loss.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
for mode in flush 2bw; do
  .venv/bin/pd2bw-train model=gpt_tiny data.seq_len=64 trainer.max_steps=$STEPS trainer.val_check_interval=$STEPS \
    trainer.limit_val_batches=32 trainer.enable_progress_bar=false trainer.enable_checkpointing=false \
    strategy.mode=$mode paths.output_dir=outputs/convergence-$mode > /dev/null 2>&1
  python3 -c "import json; s=json.load(open('outputs/convergence-$mode/summary.json')); print('$mode', 'steps', s['global_step'], 'val_loss %.4f' % s['val_loss'])"
done
