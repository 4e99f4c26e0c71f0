/* replay_main.c - the standalone `kvstash-replay` program (client/replay.h). */
#include "replay.h"

int main(int argc, char **argv)
{
    return replay_main(argc, argv);
}
