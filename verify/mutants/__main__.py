import sys

from verify.mutants.run import main

sys.exit(main())
