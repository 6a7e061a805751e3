"""Train Qwen3 with ReSPO in TRL's async trainer: a vLLM server generates while the trainer trains on what it sent.

What it does, top to bottom (``respo_trl/recipe/async_train.py``): parse a YAML ``--config`` plus overrides with TRL's
``TrlParser`` into the recipe's arguments and an ``AsyncReSPOConfig`` (every ``AsyncGRPOConfig`` field keeps its
meaning; ``--loss_type respo | vespo | clip``); build or load the model and the datasets; measure held-out accuracy;
train with ``AsyncReSPOTrainer``; measure again; save the model and ``report.json`` into ``output_dir``.

With no arguments it runs on any CPU with nothing downloaded: the built-in tiny Qwen3, warm-started on the built-in
arithmetic task, then 30 async updates whose rollouts are sampled in this process from a policy 0, 2 or 6 versions
back (``--in_process_lags``), so TRL's ``max_staleness`` rule drops some of them, as it would a slow server's.

    # CPU, nothing downloaded (docs/async.md)
    python recipes/qwen3_async_respo.py
    python recipes/qwen3_async_respo.py --loss_type clip --max_staleness 16     # TRL's loss, a looser bound

    # 1 GPU for the server, 1 for the trainer (TRL's NCCL weight sync)
    CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 trl vllm-serve --model Qwen/Qwen3-1.7B &
    CUDA_VISIBLE_DEVICES=1 accelerate launch recipes/qwen3_async_respo.py --config recipes/async/qwen3-1.7b.yaml

    # several trainer GPUs (FSDP2, as TRL's async trainer shards), one node; several nodes: accelerate's
    # --num_machines / --machine_rank / --main_process_ip flags on every node, the server reachable from rank 0
    CUDA_VISIBLE_DEVICES=1,2,3 accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 3 \\
        recipes/qwen3_async_respo.py --config recipes/async/qwen3-1.7b.yaml
"""

from respo_trl.recipe.async_train import cli

if __name__ == "__main__":  # the rollout worker is a spawned process: it must not run the recipe again
    cli()
