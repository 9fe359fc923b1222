"""Multi-LoRA serving: PEFT adapters read and checked (adapter.py), the `--*lora*` flags
(args.py), the HTTP process's adapter table (registry.py), and in each model process the device
pool of adapter slots (manager.py), one layer's LoRA (layers.py) and its segmented kernels
(sgmv.py)."""
