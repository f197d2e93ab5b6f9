from veriloop.envs._package_name import require_package_name

require_package_name(__name__, "configs")  # the folder configs/ is the package veriloop.configs
