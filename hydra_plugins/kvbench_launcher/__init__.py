"""kvbench's default Hydra launcher (`hydra/launcher=kvbench`, set in conf/config.yaml): the jobs of a sweep run in
this process, their runs grouped for shared work (kvbench.run.app.run_members); the class is in `launcher`."""
