import sys

from shardemu.cli import main

sys.exit(main())
