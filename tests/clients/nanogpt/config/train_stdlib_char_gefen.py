# A tiny character-level GPT on the standard-library text of data/stdlib_char/prepare.py, on CPU,
# with Gefen (model.configure_optimizers builds gefen_dist.Gefen: gefen.patch). Not part of nanoGPT.
#   python data/stdlib_char/prepare.py
#   PYTHONPATH=../../.. python train.py config/train_stdlib_char_gefen.py
#   PYTHONPATH=../../.. torchrun --standalone --nproc_per_node 2 train.py config/train_stdlib_char_gefen.py
#   PYTHONPATH=../../.. python train.py config/train_stdlib_char_gefen.py --init_from=resume --max_iters=30

out_dir = 'out-stdlib-char'
eval_interval = 10 # a checkpoint (ckpt.pt: model + optimizer.state_dict()) at every eval
eval_iters = 5
log_interval = 1
always_save_checkpoint = True

dataset = 'stdlib_char'
gradient_accumulation_steps = 2 # divisible by the 2 DDP ranks (1 micro step each there)
batch_size = 8
block_size = 64

n_layer = 2
n_head = 2
n_embd = 64
dropout = 0.0

learning_rate = 3e-3
max_iters = 20
lr_decay_iters = 30
min_lr = 3e-4
beta2 = 0.99
warmup_iters = 5

device = 'cpu'
dtype = 'float32'
compile = False
backend = 'gloo'
