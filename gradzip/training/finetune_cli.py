"""``gradzip finetune CHECKPOINT --train FILE --validation FILE --out DIR``: sequence
classification on top of a run's checkpoint or an exported model
(:func:`gradzip.training.finetune.finetune`); ``gradzip finetune --make-synthetic DIR`` writes the
synthetic keyword task (:mod:`gradzip.data.synthetic_cls`) and ``--make-wordnet DIR`` the WordNet
task (:mod:`gradzip.data.wordnet`). Bad input is one line, exit code 2,
and nothing is written."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradzip.errors import GradzipError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", nargs="?",
                        help="a gradzip train --out directory (its newest checkpoint, or --step) or a Hugging Face "
                             "BERT directory (gradzip export --to hf)")
    parser.add_argument("--train", metavar="FILE", help="training data: .csv/.tsv/.jsonl with text (or text_a, "
                        "text_b) and label, or hf:NAME[:CONFIG[:SPLIT]] such as hf:glue:sst2")
    parser.add_argument("--validation", metavar="FILE", help="validation data, as --train (hf: split validation)")
    parser.add_argument("--out", metavar="DIR", help="a new or empty directory for summary.json, metrics.jsonl, "
                        "predictions.jsonl and model/")
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training data (default 5)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate of AdamW (default 3e-4, for "
                        "small BERTs; BERT-base's recipe is 5e-5 over 3 epochs)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size, split across ranks "
                        "(default 32)")
    parser.add_argument("--warmup", type=float, default=0.1, help="linear warm-up, as a fraction of the steps; "
                        "then linear decay to 0 (default 0.1)")
    parser.add_argument("--seq-len", type=int, default=128, help="longest input in tokens; longer ones are cut "
                        "(default 128)")
    parser.add_argument("--seed", type=int, default=0, help="classifier initialisation, data order, dropout")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout of the encoder and the classifier "
                        "(default 0.1)")
    parser.add_argument("--init", choices=("pretrained", "random"), default="pretrained",
                        help="random: the same architecture from random weights (the baseline)")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="fine-tune the run's checkpoint of step N (default: the newest)")
    parser.add_argument("--log", metavar="SINKS", default=None,
                        help="also send the per-epoch metrics to tensorboard, wandb, mlflow (comma-separated)")
    parser.add_argument("--backend", choices=("sim", "gloo"), default=None,
                        help="sim: one process; gloo: data-parallel ranks under torchrun/mpirun/srun "
                             "(default: gloo when the launcher has several ranks, else sim)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may take (gloo)")
    parser.add_argument("--save-model", action=argparse.BooleanOptionalAction, default=True,
                        help="write the fine-tuned classifier to OUT/model as a Hugging Face "
                             "BertForSequenceClassification directory (default: on)")
    parser.add_argument("--make-synthetic", metavar="DIR", default=None,
                        help="instead: write the synthetic keyword task (train.jsonl, validation.jsonl) to DIR")
    parser.add_argument("--make-wordnet", metavar="DIR", default=None,
                        help="instead: write the WordNet task (noun glosses labelled with their lexicographer "
                             "class, 26 classes; no synset in both splits) to DIR; needs `apt-get install "
                             "wordnet-base` (or GRADZIP_WORDNET=DIR)")
    parser.add_argument("--corpus", metavar="SPEC", default=None,
                        help="--make-synthetic: the corpus whose sentences it uses (default: the built-in one)")
    parser.add_argument("--examples", type=int, nargs=2, default=None, metavar=("TRAIN", "VALIDATION"),
                        help="--make-synthetic/--make-wordnet: number of train and validation examples (default "
                             "1000 500 for --make-synthetic, every synset of each split for --make-wordnet)")


def run(args: argparse.Namespace) -> int:
    # Imported here: `gradzip --help` builds every sub-command's parser and should not load torch for it.
    if args.make_synthetic is not None and args.make_wordnet is not None:
        raise GradzipError("give one of --make-synthetic DIR and --make-wordnet DIR")
    if args.make_synthetic is not None:
        return _make_synthetic(args)
    if args.make_wordnet is not None:
        return _make_wordnet(args)
    missing = [flag for flag, v in (("CHECKPOINT", args.checkpoint), ("--train", args.train),
                                    ("--validation", args.validation), ("--out", args.out)) if not v]
    if missing:
        raise GradzipError(f"missing {', '.join(missing)}: gradzip finetune CHECKPOINT --train FILE --validation FILE "
                           "--out DIR (or --make-synthetic DIR)")
    from gradzip.comm import detect_launcher_env
    from gradzip.training.finetune import FinetuneConfig, finetune

    cfg = FinetuneConfig(checkpoint=args.checkpoint, train=args.train, validation=args.validation, out=args.out,
                         epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, warmup=args.warmup,
                         seq_len=args.seq_len, seed=args.seed, weight_decay=args.weight_decay, dropout=args.dropout,
                         init=args.init, step=args.step, log=args.log, backend=args.backend, timeout=args.timeout,
                         save_model=args.save_model)
    lead = detect_launcher_env().rank == 0
    summary = finetune(cfg, echo=lambda line: print(f"gradzip finetune: {line}", flush=True))
    if lead:
        f1 = f", f1 {summary['f1']:.4f}" if "f1" in summary else ""
        print(f"gradzip finetune: accuracy {summary['accuracy']:.4f}{f1} on {summary['examples']['validation']} "
              f"validation examples ({cfg.init} init from {summary['checkpoint']}); wrote {cfg.out}/summary.json"
              + (f" and the model to {cfg.out}/model" if cfg.save_model else ""))
    return 0


def _make_synthetic(args: argparse.Namespace) -> int:
    if args.checkpoint or args.train or args.validation or args.out:
        raise GradzipError("--make-synthetic DIR writes a data set and fine-tunes nothing: give it alone "
                           "(optionally with --corpus, --examples, --seed)")
    from gradzip.data import load_corpus
    from gradzip.data.synthetic_cls import check_task_dir, write_keyword_task

    check_task_dir(Path(args.make_synthetic))  # before the corpus, which may take minutes to build
    n_train, n_val = args.examples or (1000, 500)
    train, val = write_keyword_task(args.make_synthetic, load_corpus(args.corpus), n_train, n_val, args.seed)
    print(f"gradzip finetune: wrote {train} ({n_train} examples) and {val} ({n_val}); label 1 iff one of the "
          "keywords was inserted (see gradzip.data.synthetic_cls)")
    return 0


def _make_wordnet(args: argparse.Namespace) -> int:
    if args.checkpoint or args.train or args.validation or args.out or args.corpus:
        raise GradzipError("--make-wordnet DIR writes a data set and fine-tunes nothing: give it alone "
                           "(optionally with --examples, --seed)")
    from gradzip.data.wordnet import check_task_dir, wordnet_dir, write_wordnet_task

    check_task_dir(Path(args.make_wordnet))
    wordnet_dir()  # installed? (one line with the install command if not)
    n_train, n_val = args.examples or (None, None)
    train, val = write_wordnet_task(args.make_wordnet, n_train, n_val, args.seed)
    counts = [sum(1 for _ in open(p, encoding="utf-8")) for p in (train, val)]
    print(f"gradzip finetune: wrote {train} ({counts[0]} examples) and {val} ({counts[1]}); text: a noun synset's "
          "gloss, label: its lexicographer class (see gradzip.data.wordnet)")
    return 0
