"""The package's foundation: what every other part of ``deepspeed`` may import, and which imports nothing of it.

``logging`` holds the package logger and the rank-aware logging helpers; ``launch_env`` reads what the launcher's
environment says about ranks and the rendezvous. Neither needs torch. The layers above are stated in
docs/design/foundation.md.
"""
