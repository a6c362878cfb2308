"""kvbench's Hydra config groups (model/, policy/, task/, experiment/, hydra/), installed as the package `kvbench.conf`
(pyproject.toml maps this directory), so that importlib.resources finds them in a wheel and in an editable install."""
