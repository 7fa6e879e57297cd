_nbdgw() {
    local i cur prev opts cmd
    COMPREPLY=()
    if [[ "${BASH_VERSINFO[0]}" -ge 4 ]]; then
        cur="$2"
    else
        cur="${COMP_WORDS[COMP_CWORD]}"
    fi
    prev="$3"
    cmd=""
    opts=""

    for i in "${COMP_WORDS[@]:0:COMP_CWORD}"
    do
        case "${cmd},${i}" in
            ",$1")
                cmd="nbdgw"
                ;;
            nbdgw,certs)
                cmd="nbdgw__subcmd__certs"
                ;;
            nbdgw,client)
                cmd="nbdgw__subcmd__client"
                ;;
            nbdgw,help)
                cmd="nbdgw__subcmd__help"
                ;;
            nbdgw,policy)
                cmd="nbdgw__subcmd__policy"
                ;;
            nbdgw__subcmd__help,certs)
                cmd="nbdgw__subcmd__help__subcmd__certs"
                ;;
            nbdgw__subcmd__help,client)
                cmd="nbdgw__subcmd__help__subcmd__client"
                ;;
            nbdgw__subcmd__help,help)
                cmd="nbdgw__subcmd__help__subcmd__help"
                ;;
            nbdgw__subcmd__help,policy)
                cmd="nbdgw__subcmd__help__subcmd__policy"
                ;;
            nbdgw__subcmd__help__subcmd__policy,check)
                cmd="nbdgw__subcmd__help__subcmd__policy__subcmd__check"
                ;;
            nbdgw__subcmd__help__subcmd__policy,explain)
                cmd="nbdgw__subcmd__help__subcmd__policy__subcmd__explain"
                ;;
            nbdgw__subcmd__policy,check)
                cmd="nbdgw__subcmd__policy__subcmd__check"
                ;;
            nbdgw__subcmd__policy,explain)
                cmd="nbdgw__subcmd__policy__subcmd__explain"
                ;;
            nbdgw__subcmd__policy,help)
                cmd="nbdgw__subcmd__policy__subcmd__help"
                ;;
            nbdgw__subcmd__policy__subcmd__help,check)
                cmd="nbdgw__subcmd__policy__subcmd__help__subcmd__check"
                ;;
            nbdgw__subcmd__policy__subcmd__help,explain)
                cmd="nbdgw__subcmd__policy__subcmd__help__subcmd__explain"
                ;;
            nbdgw__subcmd__policy__subcmd__help,help)
                cmd="nbdgw__subcmd__policy__subcmd__help__subcmd__help"
                ;;
            *)
                ;;
        esac
    done

    case "${cmd}" in
        nbdgw)
            opts="-h -V --listen --tls-cert --tls-key --tls-dir --tls-client-ca --tls-crl --verified-chain-cache --tls-crl-allow-expired --tls-revoke-closes --tls-cipher-order --tls-min-version --tls-groups --tls-reload-interval --ktls --ktls-key-limit --allow-cn --allow-dns --allow-uri --policy --policy-revoke-closes --upstream --export --export-dir --export-dir-owner --upstream-sndbuf --immutable-export --immutable --cache-size --cache-block-size --read-ahead --read-ahead-depth --cache-fill-depth --max-connections --max-sessions-per-identity --max-handshakes --max-handshakes-per-source --handshake-queue --handshake-queue-per-source --handshake-queue-timeout --handshake-reserve --source-memory --source-prefix-v4 --source-prefix-v6 --proxy-protocol-from --proxy-protocol-serve-local --proxy-protocol-timeout --proxy-protocol-max-header --handshake-timeout --upstream-timeout --idle-timeout --stall-timeout --tcp-keepalive --max-payload --max-option-len --tcp-keepalive-interval --tcp-keepalive-count --max-refused-options --cork --admin-listen --admin-max-connections --admin-header-timeout --admin-keepalive-requests --admin-keepalive-timeout --admin-max-header-bytes --drain-delay --shutdown-grace --drain-answer --handover-socket --take-over --take-over-missing --after-handover --handover-timeout --handover-queue-timeout --handover-quiesce-timeout --handover-max-key-generations --handover-fdstore --landlock --threads --log-format --help --version certs policy client help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 1 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --listen)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-cert)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-key)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-dir)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-client-ca)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-crl)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --verified-chain-cache)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-revoke-closes)
                    COMPREPLY=($(compgen -W "true false" -- "${cur}"))
                    return 0
                    ;;
                --tls-cipher-order)
                    COMPREPLY=($(compgen -W "server client" -- "${cur}"))
                    return 0
                    ;;
                --tls-min-version)
                    COMPREPLY=($(compgen -W "1.2 1.3" -- "${cur}"))
                    return 0
                    ;;
                --tls-groups)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-reload-interval)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --ktls)
                    COMPREPLY=($(compgen -W "auto off" -- "${cur}"))
                    return 0
                    ;;
                --ktls-key-limit)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --allow-cn)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --allow-dns)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --allow-uri)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --policy)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --policy-revoke-closes)
                    COMPREPLY=($(compgen -W "true false" -- "${cur}"))
                    return 0
                    ;;
                --upstream)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --export)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --export-dir)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --export-dir-owner)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --upstream-sndbuf)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --immutable-export)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --cache-size)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --cache-block-size)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --read-ahead)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --read-ahead-depth)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --cache-fill-depth)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-connections)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-sessions-per-identity)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-handshakes)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-handshakes-per-source)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handshake-queue)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handshake-queue-per-source)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handshake-queue-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handshake-reserve)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --source-memory)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --source-prefix-v4)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --source-prefix-v6)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --proxy-protocol-from)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --proxy-protocol-serve-local)
                    COMPREPLY=($(compgen -W "true false" -- "${cur}"))
                    return 0
                    ;;
                --proxy-protocol-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --proxy-protocol-max-header)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handshake-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --upstream-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --idle-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --stall-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tcp-keepalive)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-payload)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-option-len)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tcp-keepalive-interval)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tcp-keepalive-count)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-refused-options)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --cork)
                    COMPREPLY=($(compgen -W "deferred per-reply off" -- "${cur}"))
                    return 0
                    ;;
                --admin-listen)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --admin-max-connections)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --admin-header-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --admin-keepalive-requests)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --admin-keepalive-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --admin-max-header-bytes)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --drain-delay)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --shutdown-grace)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --drain-answer)
                    COMPREPLY=($(compgen -W "close eshutdown" -- "${cur}"))
                    return 0
                    ;;
                --handover-socket)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --take-over)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --take-over-missing)
                    COMPREPLY=($(compgen -W "fail start" -- "${cur}"))
                    return 0
                    ;;
                --after-handover)
                    COMPREPLY=($(compgen -W "exit wait" -- "${cur}"))
                    return 0
                    ;;
                --handover-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handover-queue-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handover-quiesce-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handover-max-key-generations)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --landlock)
                    COMPREPLY=($(compgen -W "true false required" -- "${cur}"))
                    return 0
                    ;;
                --threads)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__certs)
            opts="-h --out --server-name --client-name --client-uri --days --force --ca-cert --ca-key --keep-ca-key --help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --out)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --server-name)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --client-name)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --client-uri)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --days)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --ca-cert)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --ca-key)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__client)
            opts="-h --listen --server --server-name --server-timeout --tls-dir --tls-ca --tls-cert --tls-key --tls-min-version --tls-groups --tls-reload-interval --reconnect --reconnect-timeout --replay-buffer --reply-buffer --handshake-timeout --idle-timeout --stall-timeout --tcp-keepalive --max-payload --max-option-len --max-connections --admin-listen --shutdown-grace --drain-answer --handover-socket --take-over --handover-timeout --handover-queue-timeout --handover-quiesce-timeout --handover-max-key-generations --take-over-missing --after-handover --handover-fdstore --threads --log-format --help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --listen)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --server)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --server-name)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --server-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-dir)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-ca)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-cert)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-key)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-min-version)
                    COMPREPLY=($(compgen -W "1.2 1.3" -- "${cur}"))
                    return 0
                    ;;
                --tls-groups)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tls-reload-interval)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --reconnect-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --replay-buffer)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --reply-buffer)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handshake-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --idle-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --stall-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --tcp-keepalive)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-payload)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-option-len)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-connections)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --admin-listen)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --shutdown-grace)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --drain-answer)
                    COMPREPLY=($(compgen -W "close eshutdown" -- "${cur}"))
                    return 0
                    ;;
                --handover-socket)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --take-over)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handover-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handover-queue-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handover-quiesce-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --handover-max-key-generations)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --take-over-missing)
                    COMPREPLY=($(compgen -W "fail start" -- "${cur}"))
                    return 0
                    ;;
                --after-handover)
                    COMPREPLY=($(compgen -W "exit wait" -- "${cur}"))
                    return 0
                    ;;
                --threads)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__help)
            opts="certs policy client help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__help__subcmd__certs)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__help__subcmd__client)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__help__subcmd__help)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__help__subcmd__policy)
            opts="check explain"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__help__subcmd__policy__subcmd__check)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__help__subcmd__policy__subcmd__explain)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__policy)
            opts="-h --help check explain help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__policy__subcmd__check)
            opts="-h --help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__policy__subcmd__explain)
            opts="-h --policy --cert --export --help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --policy)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --cert)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --export)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__policy__subcmd__help)
            opts="check explain help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__policy__subcmd__help__subcmd__check)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__policy__subcmd__help__subcmd__explain)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        nbdgw__subcmd__policy__subcmd__help__subcmd__help)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
    esac
}

if [[ "${BASH_VERSINFO[0]}" -eq 4 && "${BASH_VERSINFO[1]}" -ge 4 || "${BASH_VERSINFO[0]}" -gt 4 ]]; then
    complete -F _nbdgw -o nosort -o bashdefault -o default nbdgw
else
    complete -F _nbdgw -o bashdefault -o default nbdgw
fi
