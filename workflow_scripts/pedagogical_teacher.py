"""Pedagogical RL: GRPO-train a copy of the post model as the teacher; reward components per step, and
the step log's curves (training.png)."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.io.joblog import job_log
from graftlab.sampling import Engine
from graftlab.synth.pedagogical import RewardConfig, TeacherConfig, train_teacher
from graftlab.train.resume import Resume, resume_dir
from graftlab.train.settings import job_settings

p, inp, out = snakemake.params, snakemake.input, snakemake.output
t = dict(p.training)
reward = RewardConfig(**{k: t.pop(k) for k in ("beta", "strength", "min_tokens")})
with job_log(snakemake.log[0], snakemake.threads):
    cfg = TeacherConfig(**t, reward=reward, **job_settings(snakemake, backend=Engine.of(p.backend, seed=p.seed)))
    resume = Resume(resume_dir(out.teacher), p.resume_minutes)
    train_teacher(
        inp.post, inp.problems, cfg, out.teacher, out.steps, task=p.task, resume=resume, curves_out=out.curves
    )
