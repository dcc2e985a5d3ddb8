"""A rank's run, the parts every loop shares (the colocated loop, ``spmdrl.loop``; split placement's roles,
``spmdrl.split``; SFT's, ``spmdrl.sft.loop``):

    build.py   what a rank holds for an RL run, by its role, and how it is built
    learn.py   the training half of an RL step (old and reference log-probs, values, advantages, updates)
    upkeep.py  what every run does around its steps: output folder, checkpoints, validation's schedule, the
               end of each step (logging, preemption, checkpoint, plots)
"""
