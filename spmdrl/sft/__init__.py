"""Supervised fine-tuning on the RL run's engines, as verl's SFT trainer is used before RL.

    torchrun --standalone --nproc-per-node 2 -m spmdrl.sft --config configs/sft.yaml
    torchrun --standalone --nproc-per-node 2 -m spmdrl.sft data.train_files=train.parquet \\
        model.partial_pretrain=$HOME/models/Qwen2.5-0.5B-Instruct optim.lr=1e-5     # verl's SFT keys

``config`` (sections and checks; verl's SFT keys: ``spmdrl.verl.sft``), ``data`` (verl's SFT parquet
layouts, loss masks, batches), ``loop`` (the step, validation, checkpoints, the Hugging Face export) and
``__main__`` (the entry). The trained model lands in ``{trainer.output_dir}/hf``, a Hugging Face folder
with its tokenizer that the RL run takes as ``model.path``.
"""
