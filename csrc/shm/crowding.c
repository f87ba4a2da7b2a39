/* See crowding.h. */
#include <stdlib.h>
#include <string.h>

#include "crowding.h"

int jl_runnable_in_loadavg(const char *text) {
    const char *at = text;
    for (int field = 0; field < 3; field++) {
        at = strchr(at, ' ');
        if (at == NULL)
            return -1;
        at++;
    }
    char *end;
    long runnable = strtol(at, &end, 10);
    if (end == at || *end != '/' || runnable < 0 || runnable > 1 << 30)
        return -1;
    return (int)runnable;
}

int jl_outside_work_fills_the_cpus(int members, int asleep, int cpus, int runnable) {
    if (members <= cpus || runnable < 0)
        return 0;
    return runnable - (members - asleep) >= cpus;
}
