/* A qemu-user TCG plugin that counts the guest instructions a program
 * executes: every translated block adds its instruction count to one counter
 * each time it runs (an inline add, no callback). Printed at exit as
 * "guest_instructions N" on the plugin log (stderr).
 *
 * Debian's qemu-user 7.2 exports the plugin API but ships no plugins, and no
 * header: the few declarations used are written here from the API of that
 * version (QEMU_PLUGIN_VERSION 1). The counter is not atomic, so run the
 * guest with one thread.
 *
 * Build: cc -shared -fPIC -O2 -o insn_count.so insn_count.c
 * Use:   qemu-aarch64 -plugin ./insn_count.so -d plugin ... */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>

typedef uint64_t qemu_plugin_id_t;
struct qemu_info_t;
struct qemu_plugin_tb;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id,
    void (*cb)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb));
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb,
    enum qemu_plugin_op op, void *ptr, uint64_t imm);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id,
    void (*cb)(qemu_plugin_id_t id, void *userdata), void *userdata);
void qemu_plugin_outs(const char *string);

static uint64_t executed;

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64,
                                             &executed, qemu_plugin_tb_n_insns(tb));
}

static void on_exit(qemu_plugin_id_t id, void *userdata)
{
    char line[64];
    (void)id;
    (void)userdata;
    snprintf(line, sizeof line, "guest_instructions %" PRIu64 "\n", executed);
    qemu_plugin_outs(line);
}

__attribute__((visibility("default"))) int qemu_plugin_install(
    qemu_plugin_id_t id, const struct qemu_info_t *info, int argc, char **argv)
{
    (void)info;
    (void)argc;
    (void)argv;
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, on_exit, NULL);
    return 0;
}
