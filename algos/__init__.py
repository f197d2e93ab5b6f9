from veriloop.envs._package_name import require_package_name

require_package_name(__name__, "algos")  # the folder algos/ is the package veriloop.algos
