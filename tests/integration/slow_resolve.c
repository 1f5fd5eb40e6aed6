/* LD_PRELOAD shim for the heartbeat test: getaddrinfo() of the host name in
 * $SLOW_RESOLVE_NAME creates the file $SLOW_RESOLVE_STARTED, then blocks until the file
 * $SLOW_RESOLVE_RELEASE exists and fails (EAI_NONAME), as a name whose DNS server does not
 * answer would. Every other name goes to the real getaddrinfo. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int (*getaddrinfo_fn)(const char *, const char *, const struct addrinfo *,
                              struct addrinfo **);

int getaddrinfo(const char *node, const char *service, const struct addrinfo *hints,
                struct addrinfo **res) {
    const char *slow = getenv("SLOW_RESOLVE_NAME");
    if (node != NULL && slow != NULL && strcmp(node, slow) == 0) {
        const char *started = getenv("SLOW_RESOLVE_STARTED");
        const char *release = getenv("SLOW_RESOLVE_RELEASE");
        struct stat st;
        if (started != NULL) {
            int fd = open(started, O_CREAT | O_WRONLY, 0644);
            if (fd >= 0) close(fd);
        }
        while (release != NULL && stat(release, &st) != 0) usleep(10000);
        return EAI_NONAME;
    }
    getaddrinfo_fn real = (getaddrinfo_fn)dlsym(RTLD_NEXT, "getaddrinfo");
    return real(node, service, hints, res);
}
