"""subgroups/: how one rank's flat shard is cut. Into subgroups, with the byte layout of their state
(``partition``), and by the torch-style hyperparameter groups, each subgroup's segments
(``param_groups``). May import the state formats and the config's alignment; nearly every other
engine module imports it."""
