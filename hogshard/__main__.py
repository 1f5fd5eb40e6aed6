from hogshard.cli import main

main()
