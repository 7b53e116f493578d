#!/bin/sh
# repro-chaos: 4 ftdiloco replica groups (BERT-tiny, DiLoCo H = 32, topk 1 % + EF) on 2 emulated
# hosts at 100 Mbit/s, 180 s after the founding sync each; faults from seed 1. Needs root.
# The fault-free baseline runs first and last (two training seeds: the seed spread of the loss).
set -e
OUT=${OUT:-runs/repro-chaos}
COMMON="--groups 4 --hosts 2 --rate 100mbit --duration 180 --every 32 --seed 1 --recovery 5
        --model bert-tiny --compressor topk:ratio=0.01,ef=true --batch-size 8 --seq-len 64"
export OMP_NUM_THREADS=1
GZ=${GZ:-gradzip}
$GZ chaos run $COMMON --faults-per-minute 0 --train-seed 1 --train-args "--eval-batches 4" --out $OUT/f0-s1
$GZ chaos run $COMMON --faults-per-minute 1 --kinds kill --train-seed 1 --train-args "--eval-batches 4" --out $OUT/f1-kill
$GZ chaos run $COMMON --faults-per-minute 4 --kinds kill --train-seed 1 --train-args "--eval-batches 4" --out $OUT/f4-kill
$GZ chaos run $COMMON --faults-per-minute 4 --kinds kill,stall,partition --train-seed 1 --train-args "--eval-batches 4" --out $OUT/f4-mixed
$GZ chaos run $COMMON --faults-per-minute 0 --train-seed 2 --train-args "--eval-batches 4" --out $OUT/f0-s2
for s in 2 3; do  # two more fault seeds at 1 a minute (seed 2 draws no fault in the window)
  $GZ chaos run $(echo $COMMON | sed "s/--seed 1/--seed $s/") --faults-per-minute 1 --kinds kill --train-seed 1 \
      --train-args "--eval-batches 4" --out $OUT/f1-kill-seed$s
done
$GZ chaos compare $OUT/f0-s1 $OUT/f0-s2 $OUT/f1-kill $OUT/f1-kill-seed2 $OUT/f1-kill-seed3 $OUT/f4-kill \
    $OUT/f4-mixed --out docs/reproductions/repro-chaos
