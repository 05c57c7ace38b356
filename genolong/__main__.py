from genolong.cli import main

main()
