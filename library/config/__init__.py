"""Options: the schema (kohya's names), TOML + command line -> a read-only Config, kohya compatibility."""
from library.config.checks import PICKLE_CHECKPOINT_SUFFIXES, checkpoint_file_problem, read_toml
from library.config.dump import write_config
from library.config.errors import ConfigError, UserError
from library.config.parse import Config, build_parser, parse_config

__all__ = ["PICKLE_CHECKPOINT_SUFFIXES", "Config", "ConfigError", "UserError", "build_parser",
           "checkpoint_file_problem", "parse_config", "read_toml", "write_config"]
