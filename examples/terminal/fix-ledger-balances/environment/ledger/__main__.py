import sys

from . import balances

for account, total in sorted(balances(sys.argv[1] if len(sys.argv) > 1 else "journal.csv").items()):
    print(f"{account:<20} {total:>12,.2f}")
