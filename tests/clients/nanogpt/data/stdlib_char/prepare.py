"""
Prepare a character-level dataset from the running Python's own standard-library source
(argparse.py, textwrap.py, string.py), the way nanoGPT's data/shakespeare_char/prepare.py does
for tiny Shakespeare, without a download. Writes train.bin, val.bin (uint16 ids) and meta.pkl
(vocab_size, itos, stoi) next to this file, or into the directory given as the first argument.
(Not part of nanoGPT: written for gefen_dist's tests.)
"""
import argparse
import os
import pickle
import string
import sys
import textwrap

import numpy as np

out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
os.makedirs(out_dir, exist_ok=True)
data = ""
for mod in (argparse, textwrap, string):
    with open(mod.__file__, encoding="utf-8") as f:
        data += f.read()
print(f"length of dataset in characters: {len(data):,}")

chars = sorted(list(set(data)))
vocab_size = len(chars)
print(f"vocab size: {vocab_size:,}")
stoi = {ch: i for i, ch in enumerate(chars)}
itos = {i: ch for i, ch in enumerate(chars)}

n = len(data)
train_ids = np.array([stoi[c] for c in data[:int(n * 0.9)]], dtype=np.uint16)
val_ids = np.array([stoi[c] for c in data[int(n * 0.9):]], dtype=np.uint16)
print(f"train has {len(train_ids):,} tokens")
print(f"val has {len(val_ids):,} tokens")
train_ids.tofile(os.path.join(out_dir, "train.bin"))
val_ids.tofile(os.path.join(out_dir, "val.bin"))
with open(os.path.join(out_dir, "meta.pkl"), "wb") as f:
    pickle.dump({"vocab_size": vocab_size, "itos": itos, "stoi": stoi}, f)
